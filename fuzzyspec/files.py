"""Where fuzzyspec keeps what it makes once per machine (``cache_dir``), and writing a file whole: every file that
another process may read or write at the same time goes through ``write_whole``."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable


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
