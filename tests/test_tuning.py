"""The profiles kept in the cache (``tuning``): what survives a save."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fuzzyspec import tuning
from fuzzyspec.core.cost import Profile
from fuzzyspec.files import cache_dir


def test_a_save_drops_the_profiles_of_other_code_once_stale():
    """Every answer's save reads and writes ``profiles.json`` whole; profiles measured by older code (another step
    digest in the key) are never read again, so they go once stale, while another version's recent ones stay."""
    key = tuning.profile_key(None, "fp32", "auto", "cpu", False)
    assert f"step={tuning._step_code()}" in key.split("|")
    old = key.replace(f"step={tuning._step_code()}", "step=00000000")
    recent = key.replace(f"step={tuning._step_code()}", "step=11111111")
    tuning._write({old: {"target": {"1": 9.0}}, recent: {"target": {"1": 8.0}, "written": time.time() - 60}})
    assert set(tuning._saved()) == {recent}  # (the old one: no date, so written before dates were kept)
    tuning._write({old: {"target": {"1": 9.0}, "written": time.time() - tuning.STALE_S - 60}} | tuning._saved())
    assert set(tuning._saved()) == {recent}

    tuning.save(key, Profile(target={1: 7.0}))
    tuning.note(key, compile_pays=True)
    saved = json.loads(tuning.profile_path().read_text())
    assert set(saved) == {recent, key}
    assert tuning.load(key).target == {1: 7.0} and tuning.facts(key)["compile_pays"] is True


def test_profiles_go_where_fuzzyspec_profiles_says_and_the_tests_processes_keep_out_of_the_users_cache(tmp_path):
    """``$FUZZYSPEC_PROFILES`` names the file; a process the tests start inherits this session's, so a tiny model's
    costs never reach the user's own ``profiles.json`` (198 of one developer's 221 profiles had come from tests)."""
    named = tmp_path / "elsewhere.json"
    where = "from fuzzyspec import tuning; print(tuning.profile_path())"
    done = subprocess.run([sys.executable, "-c", where], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FUZZYSPEC_PROFILES": str(named)})
    assert done.stdout.strip() == str(named)
    inherited = subprocess.run([sys.executable, "-c", where], capture_output=True, text=True, timeout=120)
    assert Path(inherited.stdout.strip()) != cache_dir() / "profiles.json"
    unset = {key: value for key, value in os.environ.items() if key != "FUZZYSPEC_PROFILES"}
    default = subprocess.run([sys.executable, "-c", where], capture_output=True, text=True, timeout=120, env=unset)
    assert Path(default.stdout.strip()) == cache_dir() / "profiles.json"
