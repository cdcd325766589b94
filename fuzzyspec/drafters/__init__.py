"""Drafters: what proposes tokens for the target to check. This is the plug-in point.

A drafter implements ``core.draft.Drafter`` (``BaseDrafter`` gives the optional parts) and gets a name
in ``registry``. Here: draft LMs (``model``, ``draftlm``), EAGLE-1/2 and EAGLE-3 heads driven by one
drafter (``eagle``, ``eagle_head``, ``eagle3``; chains and EAGLE-2 trees), and prompt lookup
(``lookup``). ``chain`` is the token-by-token loop the model drafters share.
"""
from importlib import import_module

_EXPORTS = {
    "Drafter": "..core.draft", "BaseDrafter": "..core.draft", "Budget": "..core.draft", "Draft": "..core.draft",
    "draft_chain": ".chain", "common_prefix": "..core.kvcache", "ModelDrafter": ".model", "LookupDrafter": ".lookup",
    "EagleDrafter": ".eagle", "load_drafter": ".registry", "describe": ".registry", "DrafterSource": ".registry",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
