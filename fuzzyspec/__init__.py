"""fuzzyspec: fuzzy speculative decoding (FSD), speculative decoding (SD) and AR for Hugging Face causal LMs.

Layout: ``core`` (config, judging, the engine, caches, rules, divergences, sampling), ``drafters`` (the
plug-in point: the registry and every drafter), ``train``, ``eval`` (bench, tasks, quality, calibration,
lm-eval) and ``serve`` (the OpenAI-compatible server), with ``api``, ``options``, ``loading``, ``text``,
``data``, ``hf`` (the transformers hook) and ``cli`` at the top.

The public names load on first use, so ``import fuzzyspec`` (and ``fuzzyspec --help``) stays fast. Module
paths of earlier versions (``fuzzyspec.eagle``, ``fuzzyspec.server``, ...) still import: they resolve to
the modules that hold their contents now.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from importlib import import_module

__version__ = "0.3.0"

_EXPORTS = {
    "ModelPair": "api", "Result": "api",
    "DecodeConfig": "core.config", "Engine": "core.engine", "decode": "core.engine",
    "divergence": "core.divergences", "Budget": "core.draft", "Draft": "core.draft", "Drafter": "core.draft",
    "ModelDrafter": "drafters.model", "LookupDrafter": "drafters.lookup", "load_drafter": "drafters.registry",
    "RULES": "core.rules", "Sampling": "core.sampling", "Stats": "core.stats", "OptionError": "options",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'fuzzyspec' has no attribute {name!r}")


# Where the modules of the flat layout went: an old path reads its names from these, in order.
_MOVED = {
    "core.decoding": ("core.engine", "core.config", "core.judge"),
    "registry": ("drafters.registry",), "draftlm": ("drafters.draftlm",),
    "eagle": ("drafters.eagle", "drafters.eagle_head"), "eagle3": ("drafters.eagle3",),
    "lookup": ("drafters.lookup",), "objectives": ("train.objectives",), "selfdistill": ("train.selfdistill",),
    "bench": ("eval.bench",), "tasks": ("eval.tasks",), "quality": ("eval.quality",), "plot": ("eval.plot",),
    "execution": ("eval.execution",), "lmeval": ("eval.lmeval",), "calibrate": ("eval.calibrate",),
    "scheduler": ("serve.scheduler",), "server": ("serve.app", "serve.schema", "serve.replies", "serve.metrics"),
}


class _Moved(types.ModuleType):
    """An old module path: attributes come from the modules that hold them now."""

    def __init__(self, name: str, homes: tuple[str, ...]) -> None:
        super().__init__(name, f"moved to {', '.join('fuzzyspec.' + home for home in homes)}")
        self._homes = homes

    def _home_of(self, attribute: str):
        for home in self._homes:
            module = import_module(f"{__name__}.{home}")
            if hasattr(module, attribute):
                return module
        raise AttributeError(f"module {self.__name__!r} has no attribute {attribute!r}")

    def __getattr__(self, attribute: str):
        return getattr(self._home_of(attribute), attribute)

    def __setattr__(self, attribute: str, value) -> None:  # patching an old path patches the module itself
        if attribute.startswith("_"):
            super().__setattr__(attribute, value)
        else:
            setattr(self._home_of(attribute), attribute, value)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path=None, target=None):
        old = fullname.removeprefix(f"{__name__}.")
        if fullname.startswith(f"{__name__}.") and old in _MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return _Moved(spec.name, _MOVED[spec.name.removeprefix(f"{__name__}.")])

    def exec_module(self, module) -> None:
        if "lmeval" in module._homes[0]:  # importing it registers lm-eval's model: keep that side effect
            import_module(f"{__name__}.{module._homes[0]}")


if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())  # before path finders: an old file left behind must not win
