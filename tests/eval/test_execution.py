"""fuzzyspec.execution: running a program with a time limit, no network, a bare environment."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from fuzzyspec.eval.execution import OUTPUT_CHARS, run_program


def test_a_clean_exit_passes_and_its_output_is_kept() -> None:
    result = run_program("print('hello from the child')\n")
    assert result.passed and result.returncode == 0 and not result.timed_out
    assert result.output == "hello from the child\n"


def test_a_failing_program_fails_with_its_status_and_traceback() -> None:
    assert run_program("raise SystemExit(3)\n").returncode == 3
    result = run_program("def f():\n    assert 1 == 2, 'arithmetic broke'\nf()\n")
    assert not result.passed and result.returncode == 1
    assert "AssertionError: arithmetic broke" in result.output
    assert "program.py\", line 2" in result.output  # tracebacks point at the program's own lines


def test_the_program_runs_as_main_and_may_use_future_imports() -> None:
    result = run_program("from __future__ import annotations\nimport sys\n"
                         "print(__name__, sys.argv[0].endswith('program.py'))\n")
    assert result.passed, result.output
    assert result.output == "__main__ True\n"


def test_an_endless_loop_is_stopped_at_the_timeout() -> None:
    start = time.monotonic()
    result = run_program("while True:\n    pass\n", timeout=1)
    assert result.timed_out and not result.passed and result.returncode is None
    assert time.monotonic() - start < 5


def test_the_timeout_kills_the_programs_children_too(tmp_path) -> None:
    """Where files are isolated the child could not write the marker anyway; the double-fork test below
    checks that case through the PID namespace."""
    marker = tmp_path / "child-lived"
    child = f"import time; time.sleep(2); open({str(marker)!r}, 'w')"
    source = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(60)\n"
    assert run_program(source, timeout=1).timed_out
    time.sleep(3)
    assert not marker.exists()


@pytest.mark.parametrize("call", ["socket.socket()", "socket.create_connection(('127.0.0.1', 9))",
                                  "socket.getaddrinfo('localhost', 80)", "_socket.socket()"])
def test_the_network_is_disabled(call: str) -> None:
    result = run_program(f"import socket, _socket\n{call}\n")
    assert not result.passed
    assert "OSError: network disabled" in result.output


def test_modules_built_on_sockets_still_import() -> None:
    # The guard replaces socket.socket with a subclass, so `class SSLSocket(socket)` still works.
    result = run_program("import ssl, http.client, urllib.request\nprint('imported')\n")
    assert result.passed, result.output


def test_the_environment_holds_no_secrets_or_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUZZYSPEC_TEST_SECRET", "hunter2")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    result = run_program("import os\nprint(sorted(os.environ))\n")
    assert result.passed
    assert "PATH" in result.output
    assert "FUZZYSPEC_TEST_SECRET" not in result.output and "HTTPS_PROXY" not in result.output


def test_it_runs_in_a_fresh_folder_that_is_removed_afterwards() -> None:
    result = run_program("import os\nopen('litter.txt', 'w').write('x')\nprint(os.getcwd())\n")
    assert result.passed
    folder = Path(result.output.strip())
    assert folder != Path.cwd() and not (Path.cwd() / "litter.txt").exists()
    assert not folder.exists()


def test_stdin_is_closed_so_reading_input_fails_at_once() -> None:
    start = time.monotonic()
    result = run_program("input()\n", timeout=5)
    assert not result.passed and not result.timed_out
    assert "EOFError" in result.output and time.monotonic() - start < 4


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is enforced on Linux")
def test_memory_is_capped() -> None:
    result = run_program("block = bytearray(8 * 2**30)\n")
    assert not result.passed and "MemoryError" in result.output


def test_only_the_end_of_a_long_output_is_kept() -> None:
    result = run_program("print('x' * 100_000)\nprint('the end')\n")
    assert result.passed
    assert len(result.output) == OUTPUT_CHARS and result.output.endswith("x\nthe end\n")


def test_a_non_positive_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="timeout"):
        run_program("pass\n", timeout=0)


def _isolation():
    return set(run_program("pass").isolation)


def test_a_child_process_cannot_reach_even_our_own_loopback_server():
    import socket
    if "network" not in _isolation():
        pytest.skip("network namespaces are not available here")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        program = ("import subprocess, sys\n"
                   f"code = 'import socket; socket.create_connection((\"127.0.0.1\", {port}), timeout=2)'\n"
                   "sys.exit(subprocess.run([sys.executable, '-c', code]).returncode)")
        assert not run_program(program, timeout=20).passed  # the unpatched child's connect fails too


def test_a_double_fork_dies_with_the_program(tmp_path):
    if "processes" not in _isolation():
        pytest.skip("PID namespaces are not available here")
    marker = tmp_path / "escaped"
    program = ("import os, time\n"
               "if os.fork() == 0:\n"
               "    os.setsid()\n"
               "    if os.fork() == 0:\n"
               f"        time.sleep(2); open({str(marker)!r}, 'w').write('x')\n"
               "    os._exit(0)\n"
               "time.sleep(30)\n")
    assert run_program(program, timeout=1).timed_out
    time.sleep(3)
    assert not marker.exists()


def test_files_and_the_callers_environment_are_out_of_reach(tmp_path, monkeypatch):
    isolation = _isolation()
    if not {"files", "environment"} <= isolation:
        pytest.skip("mount namespaces are not available here")
    monkeypatch.setenv("FUZZYSPEC_SECRET", "hunter2")
    target = tmp_path / "written"
    result = run_program(f"open({str(target)!r}, 'w').write('x')")
    assert not result.passed and "Read-only file system" in result.output and not target.exists()
    snoop = ("import os\n"
             "for pid in os.listdir('/proc'):\n"
             "    if pid.isdigit():\n"
             "        try:\n"
             "            print(open(f'/proc/{pid}/environ').read())\n"
             "        except OSError:\n"
             "            pass\n")
    assert "hunter2" not in run_program(snoop).output
    assert run_program("open('mine.txt', 'w').write('x'); print(open('mine.txt').read())").passed


def test_a_fork_bomb_meets_the_process_limit():
    isolation = _isolation()
    if os.geteuid() == 0 and "user" not in isolation:
        pytest.skip("the process limit does not bind root, and no unprivileged user can run this Python here")
    bomb = ("import os, time\n"
            "started = 0\n"
            "try:\n"
            "    for _ in range(200):\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(3)\n"
            "            os._exit(0)\n"
            "        started += 1\n"
            "except OSError:\n"
            "    print('stopped after', started)\n"
            "    raise SystemExit(3)\n"
            "print('started', started)\n")
    result = run_program(bomb, timeout=20)
    assert "stopped after" in result.output, result.output
    assert int(result.output.split("stopped after")[1].split()[0]) < 200
