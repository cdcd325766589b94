"""fuzzyspec: fuzzy speculative decoding (FSD), speculative decoding (SD) and AR for Hugging Face causal LMs.

The public names load on first use, so ``import fuzzyspec`` (and ``fuzzyspec --help``) stays fast.
"""
from importlib import import_module

__version__ = "0.2.0"

_EXPORTS = {
    "ModelPair": "api", "Result": "api", "make_config": "api",
    "DecodeConfig": "core.decoding", "Engine": "core.decoding", "decode": "core.decoding",
    "divergence": "core.divergences", "Budget": "core.draft", "Draft": "core.draft", "Drafter": "core.draft",
    "ModelDrafter": "drafters", "LookupDrafter": "lookup", "load_drafter": "registry", "RULES": "core.rules",
    "Sampling": "core.sampling", "Stats": "core.stats",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'fuzzyspec' has no attribute {name!r}")
