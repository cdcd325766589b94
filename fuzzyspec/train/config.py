"""How a drafter is trained: ``TrainConfig``, declared without torch so the CLI builds its flags cheaply."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LOSSES = ("ce", "tv", "js")  # distillation losses (see objectives)

KINDS = ("eagle3", "eagle", "draft")  # what can be trained
DEFAULT_DRAFT_VOCAB = 16384


@dataclass
class TrainConfig:
    """How a drafter is trained (see ``train``)."""

    kind: str  # "eagle3", "eagle" (EAGLE-1/2 layout) or "draft"
    out: str
    target: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str = "cpu"
    dtype: str = "auto"  # the target's dtype; trained weights are kept in float32
    data: str = "sharegpt"  # or a folder from `fuzzyspec train data`, or a TokenDataset .npz
    eval_data: str = "sharegpt"  # held-out data, the same choices (ShareGPT's held-out split by default)
    max_tokens: int = 512  # sequences are cut to this many tokens
    limit: int | None = None  # use only the first N training sequences
    batch_size: int = 8
    lr: float = 5e-4
    warmup_steps: int = 50
    epochs: float = 1.0
    budget_minutes: float | None = None
    clip: float = 0.5
    seed: int = 0
    eval_sequences: int = 64
    checkpoint_minutes: float = 5.0
    init: str | None = None  # start from this saved drafter (same kind) instead of from scratch
    draft_vocab: int | None = None  # N; None: DEFAULT_DRAFT_VOCAB for eagle3 and draft, the whole for eagle
    loss: str = "ce"  # eagle3 and draft: ce, tv or js (see objectives)
    layers: int = 2  # draft LM: decoder layers, copied from the target's first ones
    ttt_steps: int = 6  # eagle3: unrolled draft steps per sequence ("training-time test")
    ttt_decay: float = 0.8  # eagle3: weight of step s is ttt_decay ** s
    train_lm_head: bool = False  # eagle3: train (and store) its own LM head instead of the target's rows
    feature_layers: list[int] | None = None  # eagle3: target hidden states to fuse (default: 2, L/2, L-3)
    noise: float = 0.1  # eagle: uniform noise on input features
    regression_weight: float = 1.0  # eagle
    ce_weight: float = 0.1  # eagle

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown drafter kind {self.kind!r}; valid: {', '.join(KINDS)}")
        for name in ("batch_size", "max_tokens", "layers", "eval_sequences", "ttt_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not self.epochs > 0:
            raise ValueError("lr and epochs must be > 0")
        if self.budget_minutes is not None and not self.budget_minutes > 0:
            raise ValueError(f"budget_minutes must be > 0, got {self.budget_minutes}")
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; valid: {', '.join(LOSSES)}")
        if self.kind == "eagle" and self.draft_vocab is not None:
            raise ValueError("an EAGLE-1/2 head reads the target's own LM head: train eagle3 for a reduced vocabulary")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1, got {self.draft_vocab}")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"ttt_decay must be in (0, 1], got {self.ttt_decay}")


def trained_length(folder: str | Path) -> int | None:
    """The positions our trainer cut a drafter's sequences to (``max_tokens`` in the ``metrics.json`` it wrote beside
    the weights), which its drafter reads at most (``EagleDrafter._root``, ``ModelDrafter.propose``); None for one
    trained elsewhere. After ~2,000 positions of chat the shipped EAGLE head, trained on 512, drafted better from the
    text's last 256-512 positions alone (greedy chains of 4: 2.65 tokens a pass against 2.13), as well as cheaper."""
    path = Path(folder) / "metrics.json"
    try:
        return int(json.loads(path.read_text())["config"]["max_tokens"]) if path.is_file() else None
    except (ValueError, KeyError, TypeError):
        return None
