"""Where fuzzyspec keeps what it makes once per machine (``cache_dir``); writing a file whole: every file that
another process may read or write at the same time goes through ``write_whole``; and what is made from files once,
then read back (``made_once``)."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, TypeVar

Made = TypeVar("Made")
log = logging.getLogger("fuzzyspec")


def cache_dir() -> Path:
    """Where converted weights, profiles and built kernels live: $FUZZYSPEC_CACHE, else ~/.cache/fuzzyspec."""
    return Path(os.environ.get("FUZZYSPEC_CACHE", Path.home() / ".cache" / "fuzzyspec"))


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """Make ``path`` by ``write``-ing a temporary file beside it, then renaming that into place: a reader, or
    another process writing the same file (workers sharing a folder, two commands filling one cache), sees
    the old file or the new one, never half of one. The temporary name is this process's own on any machine
    sharing the folder, and is removed if ``write`` fails; a ``write`` that makes no file replaces nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.partial{path.suffix}")
    try:
        write(temp)
        if temp.exists():
            os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def write_folder(folder: Path, write: Callable[[Path], object], replace: bool = False) -> None:
    """``write_whole`` for a folder: ``write`` fills a temporary folder beside ``folder``, which is then renamed into
    place, so a reader never sees half of one. The temporary folder is this process's and thread's own on any machine
    sharing the cache, and is removed if ``write`` fails. Where another process made ``folder`` first, its copy
    stays; ``replace`` removes an existing ``folder`` first (one found damaged)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    temp = folder.with_name(f".{folder.name}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.partial")
    try:
        write(temp)
        if replace:
            shutil.rmtree(folder, ignore_errors=True)
        try:
            temp.rename(folder)
        except OSError:
            if not folder.is_dir():  # (where it is, another process finished first; else the error is the caller's)
                raise
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@functools.cache
def _code_version() -> str:
    """What this package's code is: each source file's path, size and modification time (a changed, reinstalled or
    checked-out file changes it), and the version of torch, whose classes a kept object holds (and none of
    transformers', which a 4-bit target's answer does not import: ``core.llama``)."""
    import torch

    package = Path(__file__).parent
    stamp = hashlib.sha256(f"{torch.__version__} {package}".encode())
    for source in sorted(package.rglob("*.py")):
        status = source.stat()
        stamp.update(f"{source.relative_to(package)} {status.st_size} {status.st_mtime_ns}\n".encode())
    return stamp.hexdigest()


def made_once(name: str, sources: Sequence[Path], make: Callable[[], Made], form: str = "") -> Made:
    """What ``make()`` makes from the files ``sources`` (a model at its kernel's bytes, a drafter's rounded rows), made
    on a machine's first call and kept in the cache (``made/``), then read back memory-mapped: a page of it is read
    when first touched, and shared with every process reading the same file.

    Why: the embedded 4-bit target's GGUF blocks took 0.6 s of every run to unpack and repack for the kernel; its kept
    form loads in 25 ms. The file is named by ``name`` and a digest of the sources (their paths, sizes and
    modification times), of this package's code (``_code_version``) and of ``form`` (what else the made object
    depends on: the packing this machine's kernels read), so an edited or replaced source, another version of
    fuzzyspec, or a machine whose kernels read other bytes (a cache shared by two machines) makes it again. Of
    ``name``'s files, the two used last stay (a use marks its file's time): two versions in use by turns (two
    installs, a benchmark of two commits) keep theirs, where removing every other file made each version's runs
    make theirs again; a third one made removes the one used least lately.

    A kept file is a pickle this package wrote into its own cache (as the built kernels beside it are code it built):
    read with ``weights_only=False``, since it holds our modules. One that cannot be read is made again; one that
    cannot be written (a full disk, a read-only cache) is logged and the made object used as it is."""
    import torch

    stamp = hashlib.sha256(f"{_code_version()} {form}".encode())
    for source in sources:
        status = Path(source).stat()
        stamp.update(f"{Path(source).resolve()} {status.st_size} {status.st_mtime_ns}\n".encode())
    kept = cache_dir() / "made" / f"{name}-{stamp.hexdigest()[:16]}.pt"
    if kept.is_file():
        try:
            found = torch.load(kept, mmap=True, weights_only=False)
        except Exception as error:  # noqa: BLE001 (any unreadable file is made again: nothing is lost)
            log.warning("fuzzyspec: %s could not be read (%s: %s); making it again", kept, type(error).__name__, error)
        else:
            try:
                os.utime(kept)  # (used now: see above)
            except OSError:  # (a cache others keep, read-only here)
                pass
            return found
    made = make()
    checksums = getattr(torch.serialization, "get_crc32_options", lambda: None)()
    if checksums:  # (a memory-mapped load checks none; computing them was half the time of writing 213 MB)
        torch.serialization.set_crc32_options(False)
    try:
        write_whole(kept, lambda temp: torch.save(made, temp))
    except (OSError, RuntimeError) as error:
        log.warning("fuzzyspec: could not keep %s (%s); it is made again next time", kept, error)
        return made
    finally:
        if checksums:
            torch.serialization.set_crc32_options(True)
    others = [other for other in kept.parent.glob(f"{name}-{'?' * 16}.pt") if other != kept]
    for unused in sorted(others, key=_used_last, reverse=True)[KEPT_VERSIONS - 1:]:
        unused.unlink(missing_ok=True)
    return made


KEPT_VERSIONS = 2  # files ``made_once`` keeps of one name


def _used_last(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # (removed meanwhile by another process)
        return 0.0
