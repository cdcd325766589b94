"""Our CPU kernels: one C++ extension, built on first use on a machine for the widest instructions it has, and kept
under the fuzzyspec cache.

It holds two kernels, each with one job:

- ``int4_kernel.cpp``: products of activations with llama.cpp's 4-bit and 8-bit weight blocks (``core.int4``), and
  the few highest of a draft's logits over 4-bit rows worked out again from float rows (``core.vocab.RoundedRows``);
- ``layer_kernel.cpp``: attention over a static cache one query at a time (``core.attention``), and an eager float32
  step's RMSNorm, its rotary embedding with the cache writes, and silu(gate) * up, one call each, or a 4-bit
  target's whole decoder layer in one call (``core.step``); and a tree's kept path moved down in every layer's
  cache, one call a step (``core.kvcache``).

``ops.cpp`` makes them torch ops (checks, outputs, registration) over the plain arrays that ``kernels.h`` declares,
through torch's stable ABI (torch 2.10 or later), whose headers parse in a third of the time ATen's took.

Both compute a token's result by the same operations whatever else is in its batch, which is what lets a pass
that verifies several drafted tokens give each the logits a one-token step would (``core.attention``).
An x86 CPU with AVX2, torch 2.10 or later and a C++ compiler are needed; elsewhere ``unavailable`` says why, and
floats and PyTorch's attention serve.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import os
import platform
import sys
import threading
from pathlib import Path

import torch

from ..files import cache_dir

SOURCES = [Path(__file__).with_name(name) for name in ("ops.cpp", "int4_kernel.cpp", "layer_kernel.cpp")]
HEADER = Path(__file__).with_name("kernels.h")
ROWS = 16  # weight rows per packed group of the int4 kernel (what its products return is in whole groups)
# -ffp-contract=off: no multiply-adds fused by the compiler, so every tile computes an output alike. (No -fopenmp:
# the kernels run on torch's threads through its own parallel loop, kernels.h.)
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]
MIN_TORCH = (2, 10)  # the stable ABI ops.cpp targets (its TORCH_TARGET_VERSION)
# Wider instructions where the CPU has them (the int4 kernel's #if blocks): VNNI's one-instruction byte
# multiply-adds, in 256 bits (AVX-VNNI: 8 rows a register) or 512 (AVX-512: a whole group of 16 rows)
ISA_FLAGS = {
    "avx512-vnni": {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
                    "avx512_vnni": "-mavx512vnni"},
    "avx-vnni": {"avx_vnni": "-mavxvnni"},
    "avx2": {},
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
                          ()))


@functools.cache
def isa() -> str:
    """The instructions the kernels are built for here: the first of ``ISA_FLAGS`` whose flags the CPU has all of.
    FUZZYSPEC_INT4_ISA (avx-vnni or avx2) holds a wider machine to a narrower build, to compare them."""
    names = list(ISA_FLAGS)
    asked = os.environ.get("FUZZYSPEC_INT4_ISA", "").lower()
    allowed = names[names.index(asked):] if asked in names else names
    return next(name for name in allowed if set(ISA_FLAGS[name]) <= cpu_flags())


def torch_version() -> tuple[int, ...]:
    """torch's (major, minor) version."""
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def build_flags() -> list[str]:
    return FLAGS + list(ISA_FLAGS[isa()].values())


_building = threading.Lock()  # held while one thread builds or loads the kernels; others asking wait for it


def unavailable() -> str | None:
    """Why the kernels cannot run here, or None where they run (building them on first use on a machine, or
    waiting for ``build_soon``'s build)."""
    with _building:
        return _build()


def build_soon() -> None:
    """Build (or load) the kernels on a thread of their own, where that has not been done in this process: the
    compiler runs in other processes, so the rest can import and load meanwhile (a first use's 5-13 s of building, on
    2 cores, beside the imports and the tokenizer's conversion). Whoever asks ``available`` next waits for it. Where
    they are built already, loading them takes about a millisecond, and is done at once."""
    if _build.cache_info().currsize == 0 and not _building.locked():
        if _library().is_file():
            unavailable()
            return
        # Imported here, so the thread imports nothing: importing it imports setuptools, which edits sys.meta_path
        # and sys.path, and on the thread that raced the main thread's own imports while a model loaded (a first
        # run's tokenizer conversion once failed with ModuleNotFoundError for a module that was there).
        importlib.import_module("torch.utils.cpp_extension")
        threading.Thread(target=unavailable, name="fuzzyspec-kernels").start()


@functools.cache
def _library() -> Path:
    """Where the kernels' build for these sources, flags and torch lives (its shared library, built or not); worked
    out once a process (``build_soon`` asks, then the build it starts).

    The build is these sources, at this path, with these flags, for this torch: a change to any builds anew, beside
    the old one. (The path too: ninja rebuilds a file whose command changed, and the command names the sources'
    path, so two copies of one version, an installed one and a checkout, rebuilt each other's every time.)"""
    built_from = b"".join(source.read_bytes() for source in [*SOURCES, HEADER]) + str(HEADER.parent).encode() + \
        " ".join(build_flags()).encode() + torch.__version__.encode()
    name = f"fuzzyspec_int4_{hashlib.sha256(built_from).hexdigest()[:12]}"
    return cache_dir() / "kernels" / name / f"{name}.so"


@functools.cache
def _build() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return f"the CPU kernels need an x86 CPU with AVX2 (this is {platform.machine()})"
    if torch_version() < MIN_TORCH:
        return f"the CPU kernels need torch {'.'.join(map(str, MIN_TORCH))} or later (this is {torch.__version__})"
    library = _library()
    if not _load_built(library):
        error = _compile(library)
        if error is not None:
            return error
    # torch.compile traces the ops by what they return: x [..., K] -> [..., N]; attention keeps the query's shape
    for op in ("mm_q4", "mm_q8"):
        torch.library.register_fake(f"fuzzyspec_int4::{op}")(
            lambda x, packed: x.new_empty((*x.shape[:-1], packed.shape[0] * ROWS)))
    torch.library.register_fake("fuzzyspec_attention::attend")(
        lambda query, keys, values, mask, scale: query.new_empty(query.shape))
    return None


def _load_built(library: Path) -> bool:
    """Load the kernels where they were built already: as they are (0.6 ms), not through cpp_extension, whose import
    (setuptools) and ninja's check that the build is current took about 150 ms of every run (the library's name
    holds what it was built from, ``_library``)."""
    if not library.is_file():
        return False
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError):  # (a build cut short, or one being written now: ``_compile`` sees to it)
        return False
    return True


def _compile(library: Path) -> str | None:
    """Build the kernels into ``library``'s folder and load them (ninja's: only what changed is built again); None,
    or why they could not be."""
    from torch.utils import cpp_extension

    if not library.is_file():
        print(f"fuzzyspec: first use on this machine: building the CPU kernels (about 5-15 s; kept in "
              f"{library.parent}) ...", file=sys.stderr, flush=True)
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(library.stem, [str(source) for source in SOURCES], build_directory=str(library.parent),
                           is_python_module=False, extra_cflags=build_flags())
    except Exception as error:  # no compiler, no ninja, an unwritable cache, a failed build: each says so first
        lines = str(error).strip().splitlines()
        return f"the CPU kernels could not be built here ({type(error).__name__}: {lines[0] if lines else ''})"
    return None


def loaded() -> bool:
    """Whether the kernels are loaded in this process already (asking builds nothing)."""
    return _build.cache_info().currsize > 0 and _build() is None


def failed() -> bool:
    """Whether the kernels were tried in this process and cannot run here (asking builds nothing, and waits for no
    build under way)."""
    return _build.cache_info().currsize > 0 and _build() is not None


def available() -> bool:
    """Whether the kernels run on this machine (see ``unavailable`` for why not)."""
    return unavailable() is None
