"""A step compiled ahead of time and kept on disk: compiled once per machine, and called without dynamo.

``torch.compile`` traces a function again in every process, even where inductor's code is kept: a compiled step of
the embedded 4-bit target took 7-8.5 s a width in each process on a 2-core EPYC, its C++ already built (tracing,
AOTAutograd and frozen weights' passes). ``Kept`` compiles a function for one call's shapes with dynamo's
``aot_compile`` (the whole graph, as an artifact that can be saved), saves it beside inductor's code, and in a
later process loads it instead: about 2 s for a process's first, its C++ loaded from inductor's cache.

A call then skips dynamo altogether: no frame evaluation, no cache lookup, no guards. The guards are checked once,
on the call that compiles or loads a graph (a loaded graph whose guards refuse that call is compiled anew), so
the caller's ``key`` must tell apart every call that one graph cannot serve. Dimensions marked dynamic in the
stand-ins a graph is compiled from stay symbols in it: the target's cache capacity, so one graph serves every
capacity and a cache that doubles compiles nothing.

An artifact's name holds what its graph was made from: torch's version, this package's sources, the CPU's
instruction sets, the model's structure (its config, and every parameter's and buffer's name, shape and dtype, not
their values: the weights are inputs of the graph, read from the model the caller passes) and the call's key.
A graph no process has loaded or compiled for ``UNUSED_DAYS`` is deleted (``prune``, after each compilation).

Measured on the 2-core EPYC (2026-11-28, the embedded 4-bit target, ``benchmarks/bench_kept.py``): a 1-token pass
took 3.76 ms called so, one graph for every capacity, against 3.92 through dynamo with frozen weights (the way
before), and preparing the default job's 10 graphs (the target's and its EAGLE head's) in a later process 4.3 s
against 42 s. Weights are not frozen here (``aot_compile`` does not take them), which cost dynamo's calls about 13%.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from . import kernels

PACKAGE = Path(__file__).parent.parent
# (all of the package's code, not only the core's: a head's step is written in ``drafters``, and a graph kept from
# other code would run that code, unchecked: its guards see the inputs, not the source)
SOURCES = sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cpp", ".h"))
# A kept graph that no process has loaded or compiled for this long is deleted: each new torch, version of this
# package or model names new graphs (about 3 MB a width for the embedded target), and the old would stay forever.
UNUSED_DAYS = 30


class NotKept(RuntimeError):
    """A ``Kept`` function's first graph for a call could not be compiled ahead: a function dynamo cannot compile
    whole, or a torch without ``aot_compile``. The caller falls back to dynamo's graphs, compiled in each process."""


def folder() -> Path:
    """Where kept graphs go: beside inductor's code (``TORCHINDUCTOR_CACHE_DIR``, which the CLI points at a folder
    per kind of CPU, ``cli._persist_compiled_code``), whose C++ they load."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "fuzzyspec-steps"


def marked_like(tensor: Tensor, *dims: int) -> Tensor:
    """A stand-in for ``tensor`` for a graph to be compiled from (its values unset), with ``dims`` marked dynamic.
    Marked in place, the caller's own tensor would not pass a kept graph's guards when a later process loads it:
    dynamo refuses a tensor marked where it compiled an unmarked one. Made in the tensor's inference mode, which
    the guards tell apart too."""
    with torch.inference_mode(tensor.is_inference()):
        stand_in = torch.empty_like(tensor)
    for dim in dims:
        torch._dynamo.mark_dynamic(stand_in, dim)
    return stand_in


def structure(model: nn.Module) -> str:
    """What a model's graphs depend on besides its weights' values: its config and the names, shapes and dtypes of
    its parameters and buffers."""
    config = getattr(model, "config", None)
    lines = [type(model).__qualname__, config.to_json_string() if config is not None else ""]
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        lines.append(f"{name} {tuple(tensor.shape)} {tensor.dtype} {tensor.device.type}")
    return "\n".join(lines)


def fingerprint(*parts: str) -> str:
    """A name for graphs made from ``parts`` (a model's ``structure``, a function's name) by this torch, this
    package's sources and this CPU's kernels."""
    digest = hashlib.sha256()
    try:
        isa = kernels.isa()
    except StopIteration:  # (no x86 instruction set the kernels know)
        isa = ""
    for part in (torch.__version__, f"{sys.version_info[:2]}", torch.backends.cpu.get_cpu_capability(), isa,
                 _sources(), *parts):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:20]


@functools.cache
def _sources() -> str:
    """The digest of ``SOURCES``, read once a process."""
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    return digest.hexdigest()


class Kept:
    """``function`` compiled ahead for each call ``key`` it meets (``aot_compile``, one graph per key, compiled from
    ``stand_ins(arguments)`` where given: the dimensions marked dynamic there stay symbols), kept in
    ``folder() / name`` and loaded from there by a later process. Where a first graph cannot be compiled it warns,
    naming ``what`` it compiles, and raises ``NotKept``.
    ``compiling`` says whether the last call compiled or loaded a graph (its time is then not a step's)."""

    def __init__(self, function: Callable, name: str, what: str, options: dict | None = None,
                 stand_ins: Callable[[tuple], tuple] | None = None) -> None:
        self.function, self.name, self.what, self.options = function, name, what, options
        self.stand_ins = stand_ins  # a call's arguments as its graph is compiled from (where dimensions are marked)
        self.calls: dict[tuple, Callable] = {}
        self.compiling = False

    def path(self, key: tuple) -> Path:
        return folder() / self.name / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:20]}.bin"

    def ready(self, key: tuple) -> bool:
        """Whether a call with ``key`` runs a graph compiled already (in this process or kept on disk)."""
        return key in self.calls or self.path(key).is_file()

    def __call__(self, key: tuple, *arguments):
        direct = self.calls.get(key)
        self.compiling = direct is None
        if direct is None:
            try:
                direct = self._load(key, arguments) or self._compile(key, arguments)
            except Exception as error:
                first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                warnings.warn(f"fuzzyspec: {self.what} could not be compiled ahead ({type(error).__name__}: {first}); "
                              "compiling it as each process meets it", stacklevel=3)
                raise NotKept(self.what) from error
            direct.disable_guard_check()  # (checked: this call's, against the graph)
            self.calls[key] = direct
        return direct(*arguments)

    def _load(self, key: tuple, arguments: tuple):
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            with open(path, "rb") as file:
                direct = torch.compiler.load_compiled_function(file)
            if direct.guard_check(*arguments):
                _used(path)
                return direct
        except Exception:  # (a file cut short, or one of another make: compiled anew below, and replaced)
            pass
        return None

    def _compile(self, key: tuple, arguments: tuple):
        import torch._inductor.config as inductor

        with inductor.patch(freezing=False):
            compiled = torch.compile(self.function, fullgraph=True, dynamic=False, options=self.options)
            direct = compiled.aot_compile((self.stand_ins(arguments) if self.stand_ins else arguments, {}))
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            direct.save_compiled_function(str(path))
        except Exception as error:  # (an unwritable cache: this process keeps it all the same)
            warnings.warn(f"fuzzyspec: a compiled step could not be kept in {path.parent}: {error}", stacklevel=2)
        prune()  # (after a compilation, when a new name's graphs appear; a few files' dates, against seconds)
        return direct


def _used(path: Path) -> None:
    """Mark a kept graph used now (its modification time), so that ``prune`` keeps it."""
    try:
        os.utime(path)
    except OSError:  # (a cache this process may read but not write)
        pass


def prune(days: float = UNUSED_DAYS) -> list[Path]:
    """Delete the kept graphs that no process has loaded or compiled for ``days``, and the folders left empty;
    return the graphs deleted."""
    limit, deleted = time.time() - days * 86400, []
    for path in folder().glob("*/*.bin"):
        try:
            if path.stat().st_mtime < limit:
                path.unlink()
                deleted.append(path)
        except OSError:  # (gone already, or not ours to delete)
            pass
    for parent in {path.parent for path in deleted}:
        try:
            parent.rmdir()
        except OSError:  # (not empty)
            pass
    return deleted
