"""Training drafters: ``config`` (TrainConfig), ``loop`` (the training loop), ``objectives`` (what each
drafter kind learns), ``selfdistill`` (the target's own answers as training data)."""
from importlib import import_module

_EXPORTS = {"TrainConfig": ".config", "KINDS": ".config", "LOSSES": ".config", "DEFAULT_DRAFT_VOCAB": ".config",
            "train": ".loop", "evaluate": ".loop", "make_objective": ".loop", "load_data": ".loop",
            "build_vocab": ".loop", "padded_batches": ".loop"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
