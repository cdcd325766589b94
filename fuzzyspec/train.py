"""Training drafters for a target: an EAGLE head, or a small draft LM distilled from it.

Both learn from the target itself on ShareGPT conversations rendered with its
chat template: the target is run (frozen, no gradients) on each batch and its
outputs are the labels, so the draft learns what the target would say there.

- EAGLE head: loss = regression_weight * SmoothL1(f_hat, f) + ce_weight * CE(p_target, lm_head(f_hat)),
  with uniform noise of +-``noise`` on the input features (EAGLE's recipe:
  weights 1.0 and 0.1).
- Draft LM: loss = KL(p_target || p_draft) at every position.

The learning rate warms up linearly, then follows a cosine to a tenth of its
peak over the run (its steps, or its time budget if that ends first).

Runs are seeded and resumable: ``checkpoint.pt`` in the output folder holds the
step, weights, optimizer and random state, and a new run with the same folder
goes on from there. ``budget_minutes`` stops a run (saving everything) after
that much wall time, so long training can be split into pieces.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm
from transformers import PreTrainedModel

from .data import TokenDataset, cached_token_dataset
from .draftlm import load_draft_lm, make_draft_lm, own_weights, save_draft_lm
from .eagle import EagleHead, load_head
from .loading import load_model

KINDS = ("eagle", "draft")


@dataclass
class TrainConfig:
    kind: str  # "eagle" or "draft"
    out: str
    target: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str = "cpu"
    dtype: str = "auto"  # the target's dtype; trained weights are kept in float32
    max_tokens: int = 384  # conversations are cut to this many tokens
    limit: int | None = None  # use only the first N training conversations
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
    layers: int = 2  # draft LM: decoder layers, copied from the target's first ones
    noise: float = 0.1  # EAGLE: uniform noise on input features
    regression_weight: float = 1.0
    ce_weight: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown drafter kind {self.kind!r}; valid: {', '.join(KINDS)}")
        for name in ("batch_size", "max_tokens", "layers", "eval_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not self.epochs > 0:
            raise ValueError("lr and epochs must be > 0")
        if self.budget_minutes is not None and not self.budget_minutes > 0:
            raise ValueError(f"budget_minutes must be > 0, got {self.budget_minutes}")


def padded_batches(dataset: TokenDataset, batch_size: int, seed: int, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Batches of (tokens [B, T] right-padded with 0, lengths [B]) in a seeded order per epoch.

    Right padding needs no attention mask: with causal attention no real
    position ever sees a pad, and losses ignore pad positions.
    """
    order = np.random.default_rng(seed + epoch).permutation(len(dataset))
    for start in range(0, len(order) - batch_size + 1, batch_size):
        yield _pad([dataset[int(i)] for i in order[start:start + batch_size]])


def _pad(rows: list[np.ndarray]) -> tuple[Tensor, Tensor]:
    """Token rows -> (tokens [B, T] right-padded with 0, lengths [B])."""
    lengths = torch.tensor([len(r) for r in rows])
    tokens = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.from_numpy(row.astype(np.int64))
    return tokens, lengths


def _valid(lengths: Tensor, width: int, shift: int = 0) -> Tensor:
    """[B, width] mask of positions t with t + shift < length."""
    return (torch.arange(width, device=lengths.device)[None] + shift) < lengths[:, None]


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp_min(1)


class EagleObjective:
    """Trains an EAGLE head on the target's features."""

    def __init__(self, target: PreTrainedModel, config: TrainConfig) -> None:
        self.target, self.config = target, config
        self.model = EagleHead.for_target(target).float()
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()

    def _features(self, tokens: Tensor) -> Tensor:
        with torch.inference_mode():
            out = self.target(input_ids=tokens, output_hidden_states=True, logits_to_keep=1)
        return out.hidden_states[-1].float().clone()

    def _predict(self, tokens: Tensor, features: Tensor, noise: float) -> Tensor:
        inputs = features[:, :-1]
        if noise:
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
        return self.model(self.embed(tokens[:, 1:]).float(), inputs)

    def loss(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, float]:
        features = self._features(tokens)
        predicted = self._predict(tokens, features, self.config.noise)
        valid = _valid(lengths, tokens.shape[1] - 1, shift=1)
        regression = _masked_mean(F.smooth_l1_loss(predicted, features[:, 1:], reduction="none").mean(-1), valid)
        with torch.no_grad():
            target_logits = self.lm_head(features[:, 1:].to(self.lm_head.weight.dtype)).float()
        logits = self.lm_head(predicted.to(self.lm_head.weight.dtype)).float()
        cross_entropy = _masked_mean(-(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1), valid)
        agreement = _masked_mean((logits.argmax(-1) == target_logits.argmax(-1)).float(), valid)
        loss = self.config.regression_weight * regression + self.config.ce_weight * cross_entropy
        return loss, float(agreement)

    @torch.no_grad()
    def agreement(self, tokens: Tensor, lengths: Tensor) -> tuple[float, int]:
        """Held-out top-1 agreement with the target's greedy token, teacher-forced: (rate, positions)."""
        features = self._features(tokens)
        predicted = self._predict(tokens, features, 0.0)
        dtype = self.lm_head.weight.dtype
        same = self.lm_head(predicted.to(dtype)).argmax(-1) == self.lm_head(features[:, 1:].to(dtype)).argmax(-1)
        valid = _valid(lengths, tokens.shape[1] - 1, shift=1)
        return float(same[valid].float().mean()), int(valid.sum())

    def trainable(self) -> dict[str, Tensor]:
        return self.model.state_dict()

    def save(self, folder: Path) -> None:
        head = EagleHead.for_target(self.target, self.model.config)
        head.load_state_dict(self.model.state_dict())
        head.to(torch.bfloat16).save(folder)


class DraftObjective:
    """Distils a small draft LM (shared embedding and LM head) from the target."""

    def __init__(self, target: PreTrainedModel, config: TrainConfig) -> None:
        self.target, self.config = target, config
        self.model = make_draft_lm(target, config.layers)
        shared = {id(target.get_input_embeddings().weight), id(target.get_output_embeddings().weight)}
        for weight in self.model.parameters():
            if id(weight) not in shared:  # trained weights in float32; the shared ones stay frozen as they are
                weight.data = weight.data.float()

    def _logits(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        with torch.inference_mode():
            target_logits = self.target(input_ids=tokens).logits.float().clone()
        return target_logits, self.model(input_ids=tokens).logits.float()

    def loss(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, float]:
        target_logits, logits = self._logits(tokens)
        valid = _valid(lengths, tokens.shape[1])
        log_p = target_logits.log_softmax(-1)
        kl = (log_p.exp() * (log_p - logits.log_softmax(-1))).sum(-1)
        agreement = _masked_mean((logits.argmax(-1) == target_logits.argmax(-1)).float(), valid)
        return _masked_mean(kl, valid), float(agreement)

    @torch.no_grad()
    def agreement(self, tokens: Tensor, lengths: Tensor) -> tuple[float, int]:
        target_logits, logits = self._logits(tokens)
        valid = _valid(lengths, tokens.shape[1])
        same = logits.argmax(-1) == target_logits.argmax(-1)
        return float(same[valid].float().mean()), int(valid.sum())

    def trainable(self) -> dict[str, Tensor]:
        return own_weights(self.model)

    def save(self, folder: Path) -> None:
        save_draft_lm(self.model, folder)


def evaluate(objective, dataset: TokenDataset, batch_size: int, autocast: torch.autocast) -> float:
    """Held-out top-1 agreement over the whole of ``dataset``, weighted by positions."""
    matched = total = 0.0
    for start in range(0, len(dataset), batch_size):
        tokens, lengths = _pad([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        with autocast:
            rate, count = objective.agreement(tokens.to(objective.target.device), lengths.to(objective.target.device))
        matched += rate * count
        total += count
    return matched / max(total, 1)


def train(config: TrainConfig, train_data: TokenDataset | None = None, eval_data: TokenDataset | None = None,
          target: PreTrainedModel | None = None, tokenizer=None, progress: bool = True) -> dict:
    """Train a drafter as ``config`` says; returns the metrics also written to ``out/metrics.json``."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    if target is None:
        target, tokenizer = load_model(config.target, config.dtype, config.device)
    target.requires_grad_(False)
    if train_data is None:
        name = f"sharegpt-train-{config.max_tokens}" + (f"-first{config.limit}" if config.limit else "")
        train_data = cached_token_dataset(tokenizer, name, split="train", max_tokens=config.max_tokens,
                                          limit=config.limit)
    if eval_data is None:
        eval_data = cached_token_dataset(tokenizer, f"sharegpt-held_out-{config.max_tokens}", split="held_out",
                                         max_tokens=config.max_tokens)
    if len(eval_data) > config.eval_sequences:
        eval_data = TokenDataset.from_sequences(eval_data[i] for i in range(config.eval_sequences))

    objective = EagleObjective(target, config) if config.kind == "eagle" else DraftObjective(target, config)
    if config.init:
        saved = load_head(config.init, target) if config.kind == "eagle" else load_draft_lm(config.init, target)
        weights = saved.state_dict() if config.kind == "eagle" else own_weights(saved)
        objective.model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    params = [p for p in objective.model.parameters() if p.requires_grad and p.dtype == torch.float32]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    steps_per_epoch = len(train_data) // config.batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"{len(train_data)} training sequences are fewer than one batch of {config.batch_size}")
    total_steps = max(1, math.ceil(config.epochs * steps_per_epoch))
    step, trained_tokens, elapsed = 0, 0, 0.0
    checkpoint = out / "checkpoint.pt"
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        if state["kind"] != config.kind:
            raise ValueError(f"{checkpoint} holds a {state['kind']} run, not {config.kind}")
        objective.model.load_state_dict(state["weights"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step, trained_tokens, elapsed = state["step"], state["tokens"], state["elapsed"]

    def save_checkpoint() -> None:
        state = {"kind": config.kind, "weights": objective.trainable(), "optimizer": optimizer.state_dict(),
                 "rng": torch.get_rng_state(), "step": step, "tokens": trained_tokens,
                 "elapsed": elapsed + time.perf_counter() - start}
        torch.save(state, checkpoint.with_suffix(".tmp"))
        checkpoint.with_suffix(".tmp").replace(checkpoint)

    start = last_save = time.perf_counter()
    budget_s = config.budget_minutes * 60 if config.budget_minutes else math.inf
    bar = tqdm(total=total_steps, initial=step, desc=f"train {config.kind}", unit="step", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    stopped_by_budget = False
    # Trained weights stay float32; matrix products run in the target's low precision when it has one.
    autocast = torch.autocast(target.device.type, dtype=target.dtype, enabled=target.dtype != torch.float32)
    objective.model.train()
    try:
        while step < total_steps:
            epoch, skip = divmod(step, steps_per_epoch)
            for tokens, lengths in padded_batches(train_data, config.batch_size, config.seed, epoch):
                if skip:
                    skip -= 1
                    continue
                if step >= total_steps:
                    break
                if time.perf_counter() - start >= budget_s:
                    stopped_by_budget = True
                    break
                # Linear warm-up, then cosine decay to a tenth over the run: its steps or its time budget,
                # whichever ends first, so a budgeted run still anneals.
                progress = max(step / total_steps, (time.perf_counter() - start) / budget_s)
                decay = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
                for group in optimizer.param_groups:
                    group["lr"] = config.lr * min(1.0, (step + 1) / config.warmup_steps) * decay
                tokens, lengths = tokens.to(target.device), lengths.to(target.device)
                with autocast:
                    loss, agreement = objective.loss(tokens, lengths)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, config.clip)
                optimizer.step()
                step += 1
                trained_tokens += int(lengths.sum())
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{agreement:.2f}")
                if time.perf_counter() - last_save >= config.checkpoint_minutes * 60:
                    save_checkpoint()
                    last_save = time.perf_counter()
            if stopped_by_budget:
                break
    except KeyboardInterrupt:  # keep what was trained: rerunning the same command resumes from here
        bar.close()
        save_checkpoint()
        print(f"fuzzyspec: interrupted at step {step}; checkpoint saved in {checkpoint}", file=sys.stderr)
        raise
    bar.close()
    objective.model.eval()
    save_checkpoint()
    objective.save(out)
    metrics = {"kind": config.kind, "steps": step, "total_steps": total_steps, "trained_tokens": trained_tokens,
               "train_seconds": round(elapsed + time.perf_counter() - start, 1),
               "finished": step >= total_steps,
               "held_out_top1_agreement": round(evaluate(objective, eval_data, config.batch_size, autocast), 4),
               "held_out_sequences": len(eval_data), "config": dataclasses.asdict(config)}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
