"""Running a model-written Python program in a subprocess, with a time limit and no network.

Used to score code tasks (HumanEval): the program is the model's completion plus the task's
tests, and it passes when it exits with status 0.

This is a guard against accidents, not a security sandbox. A model's code might loop
forever, eat all memory, wait on stdin, litter the working directory or reach for the
network; each of those is stopped or confined here. Code written to escape (restoring the
socket module, starting a new session, raising its own limits) can escape: run untrusted
code you fear inside a container or VM.

What is done, and why:

* the program runs in a fresh temporary directory (removed afterwards), so files it writes
  land nowhere that matters;
* ``python -I`` (isolated mode) with an environment holding only ``PATH``: no user site
  packages, no ``PYTHON*`` variables, no proxy settings or credentials from our environment;
* stdin is closed, so a program waiting for input fails instead of hanging;
* it runs in its own session (process group); on timeout the whole group is killed, so
  children it started die with it;
* a short prelude, run in the child before the program, caps the address space (4 GiB on
  POSIX) and replaces ``socket.socket``, ``socket.create_connection`` and
  ``socket.getaddrinfo`` with versions that raise ``OSError("network disabled")``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

MEMORY_LIMIT = 4 * 2**30  # bytes of address space for the program
OUTPUT_CHARS = 2000       # how much of the program's output ProgramResult keeps (the end)
PROGRAM_NAME = "program.py"

# Runs in the child before the program. The limit is set here rather than in a preexec_fn:
# preexec_fn is documented as unsafe in a parent with threads (torch starts several), and
# setting it first thing in the child has the same effect on the program.
# The program is compiled from its own file, so `from __future__` imports and line numbers in
# tracebacks are its own, and it runs as a module named __main__.
_PRELUDE = '''\
import sys
try:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
except (ImportError, ValueError, OSError):
    pass

import _socket
import socket


def _network_disabled(*args, **kwargs):
    raise OSError("network disabled")


class _NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        raise OSError("network disabled")


socket.socket = _socket.socket = _NoSocket
socket.create_connection = socket.getaddrinfo = _network_disabled

import types
_main = types.ModuleType("__main__")
_main.__file__ = {path!r}
sys.modules["__main__"] = _main
sys.argv[0] = {path!r}
with open({path!r}, encoding="utf-8") as _file:
    _code = compile(_file.read(), {path!r}, "exec")
exec(_code, _main.__dict__)
'''


@dataclass
class ProgramResult:
    """How a program ended. ``passed`` means it exited with status 0 within the time limit."""

    passed: bool
    returncode: int | None  # None when it was killed for running past the time limit
    timed_out: bool
    output: str             # the last OUTPUT_CHARS characters of stdout and stderr, interleaved


def run_program(source: str, timeout: float = 10.0) -> ProgramResult:
    """Run ``source`` as a Python program under ``sys.executable``; see the module docstring for the guards."""
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    with tempfile.TemporaryDirectory(prefix="fuzzyspec-run-") as folder:
        program = Path(folder) / PROGRAM_NAME
        program.write_text(source, encoding="utf-8")
        runner = Path(folder) / "_run.py"
        runner.write_text(_PRELUDE.format(limit=MEMORY_LIMIT, path=str(program)), encoding="utf-8")
        return _run([sys.executable, "-I", str(runner)], folder, timeout)


def _run(command: list[str], folder: str, timeout: float) -> ProgramResult:
    """Run ``command`` in ``folder``; kill its process group if it outlives ``timeout`` seconds."""
    environment = {"PATH": os.environ.get("PATH", os.defpath)}
    if os.name == "nt" and "SYSTEMROOT" in os.environ:  # Python on Windows cannot start without it
        environment["SYSTEMROOT"] = os.environ["SYSTEMROOT"]
    process = subprocess.Popen(
        command, cwd=folder, env=environment, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=os.name == "posix",
        creationflags=getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0))
    # Read in a thread keeping only the tail: a program printing in a loop must not fill
    # our memory (communicate() keeps everything) or block on a full pipe.
    tail = bytearray()

    def read() -> None:
        assert process.stdout is not None
        for chunk in iter(lambda: process.stdout.read1(65536), b""):  # type: ignore[union-attr]
            tail.extend(chunk)
            del tail[:-4 * OUTPUT_CHARS]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        returncode: int | None = process.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        returncode, timed_out = None, True
    finally:
        _kill_group(process)  # on timeout the program itself; else any children it left behind
        process.wait()
    # Everything that held the pipe is dead, bar children that left the group: don't wait on those.
    reader.join(timeout=1.0)
    output = bytes(tail).decode("utf-8", errors="replace")[-OUTPUT_CHARS:]
    return ProgramResult(passed=returncode == 0, returncode=returncode, timed_out=timed_out, output=output)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process's whole group (POSIX), or the process alone elsewhere."""
    if os.name == "posix":
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # already gone
    elif process.poll() is None:
        process.kill()
