"""Training drafters for a target: an EAGLE-3 head, an EAGLE-1/2 head, or a small draft LM.

All learn from the target itself: the target is run (frozen, no gradients) on
each batch and its next-token distributions are the labels, so the draft learns
what the target would say there (``objectives`` holds what each kind learns).
The text they read is either ShareGPT conversations rendered with the target's
chat template (``data="sharegpt"``), or the target's own answers to training
prompts (``data=FOLDER`` made by ``fuzzyspec train data``: self-distillation,
where the drafter sees exactly the text it will have to predict).

A reduced draft vocabulary (``draft_vocab`` = N) is the N tokens the target
emits most in the training data (its answers only, when the data marks them),
plus its end-of-sequence tokens.

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
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm
from transformers import PreTrainedModel

from ..api import eos_token_ids
from ..core.vocab import DraftVocab, most_frequent, token_counts
from ..data import TokenDataset, cached_token_dataset
from ..drafters.draftlm import load_draft_lm, own_weights
from ..drafters.eagle3 import load_eagle3
from ..drafters.eagle_head import load_head
from ..loading import load_model, logit_width
from .config import DEFAULT_DRAFT_VOCAB, TrainConfig
from .objectives import DraftObjective, Eagle3Objective, EagleObjective

def padded_batches(dataset: TokenDataset, batch_size: int, seed: int, epoch: int
                   ) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """Batches of (tokens [B, T] right-padded with 0, lengths [B], loss_from [B]) in a seeded order per epoch.

    Right padding needs no attention mask: with causal attention no real
    position ever sees a pad, and losses ignore pad positions.
    """
    order = np.random.default_rng(seed + epoch).permutation(len(dataset))
    for start in range(0, len(order) - batch_size + 1, batch_size):
        yield _pad(dataset, order[start:start + batch_size])


def _pad(dataset: TokenDataset, indices) -> tuple[Tensor, Tensor, Tensor]:
    """Sequences ``indices`` of ``dataset`` -> (tokens [B, T] right-padded with 0, lengths [B], loss_from [B])."""
    rows = [dataset[int(i)] for i in indices]
    lengths = torch.tensor([len(r) for r in rows])
    tokens = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.from_numpy(row.astype(np.int64))
    return tokens, lengths, torch.tensor([int(dataset.loss_from[int(i)]) for i in indices])


def load_data(source: str, tokenizer, split: str, max_tokens: int, limit: int | None = None) -> TokenDataset:
    """Training or held-out data: ``sharegpt`` (that split, rendered and cached), a folder of the target's
    own answers (``fuzzyspec train data``), or a TokenDataset ``.npz``; sequences cut to ``max_tokens``."""
    if source == "sharegpt":
        name = f"sharegpt-{split}-{max_tokens}" + (f"-first{limit}" if limit else "")
        return cached_token_dataset(tokenizer, name, split=split, max_tokens=max_tokens, limit=limit)
    from .selfdistill import load_answers

    path = Path(source)
    if path.is_dir():
        dataset = load_answers(path)
    elif path.suffix == ".npz" and path.is_file():
        dataset = TokenDataset.load(path)
    else:
        raise ValueError(f"training data {source!r} is neither 'sharegpt', a folder from `fuzzyspec train data`, "
                         "nor a .npz file")
    count = len(dataset) if limit is None else min(limit, len(dataset))
    keep = [i for i in range(count) if min(len(dataset[i]), max_tokens) > dataset.loss_from[i]]
    return TokenDataset.from_sequences([dataset[i][:max_tokens] for i in keep], dataset.meta,
                                       [int(dataset.loss_from[i]) for i in keep])


def build_vocab(dataset: TokenDataset, size: int, vocab_size: int, always: tuple[int, ...] = ()) -> DraftVocab:
    """The ``size`` tokens most frequent in the learned part of ``dataset`` (plus ``always``)."""
    learned = (sequence[start:] for sequence, start in zip(dataset, dataset.loss_from))
    return most_frequent(token_counts(learned, vocab_size), size, always)


def make_objective(config: TrainConfig, target: PreTrainedModel, train_data: TokenDataset, tokenizer=None):
    """The objective for ``config.kind``, with its draft vocabulary, started from ``config.init`` if set."""
    if config.kind == "eagle":
        objective = EagleObjective(target, config)
        if config.init:
            objective.load(load_head(config.init, target).state_dict())
        return objective
    saved = None
    if config.init:
        saved = load_eagle3(config.init, target) if config.kind == "eagle3" else load_draft_lm(config.init, target)
        vocab = saved.vocab
        vocab = vocab.to("cpu") if vocab is not None else None
    else:
        size = config.draft_vocab or DEFAULT_DRAFT_VOCAB
        width = logit_width(target)
        eos = set(eos_token_ids(target.generation_config))
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        vocab = build_vocab(train_data, size, width, tuple(sorted(eos))) if size < width else None
        if vocab is None and config.kind == "eagle3":
            vocab = DraftVocab(torch.arange(width), width)
    if config.kind == "eagle3":
        objective = Eagle3Objective(target, config, vocab)
        if saved is not None:
            objective.load(saved.state_dict())
    else:
        objective = DraftObjective(target, config, vocab)
        if saved is not None:
            objective.load(own_weights(saved.model))
    return objective


JS_THRESHOLDS = (0.05, 0.1, 0.2, 0.3, 0.5)


def evaluate(objective, dataset: TokenDataset, batch_size: int, autocast: torch.autocast) -> list[dict]:
    """Held-out, teacher-forced measures per draft step (EAGLE-3 heads unroll several; others have one):
    top-1 agreement with the target's greedy token, SD's mean acceptance probability 1 - TV(p, q), JS
    quantiles, and the share of positions FSD with JS would accept at a few thresholds."""
    steps: list[list] = []
    device = objective.target.device
    for start in range(0, len(dataset), batch_size):
        tokens, lengths, loss_from = _pad(dataset, range(start, min(start + batch_size, len(dataset))))
        with autocast:
            results = objective.evaluate(tokens.to(device), lengths.to(device), loss_from.to(device))
        for i, result in enumerate(results):
            if i >= len(steps):
                steps.append([])
            steps[i].append(result)
    summary = []
    for results in steps:
        same = torch.cat([r.same for r in results]).float()
        tv, js = torch.cat([r.tv for r in results]), torch.cat([r.js for r in results])
        if not same.numel():
            continue
        summary.append({
            "positions": same.numel(), "top1": round(float(same.mean()), 4),
            "sd_acceptance": round(float(1 - tv.mean()), 4),
            "js_quantiles": {str(q): round(float(js.quantile(q)), 4) for q in (0.1, 0.25, 0.5, 0.75, 0.9)},
            "fsd_js_acceptance": {str(t): round(float((js <= t).float().mean()), 4) for t in JS_THRESHOLDS}})
    return summary


def train(config: TrainConfig, train_data: TokenDataset | None = None, eval_data: TokenDataset | None = None,
          target: PreTrainedModel | None = None, tokenizer=None, progress: bool = True) -> dict:
    """Train a drafter as ``config`` says; returns the metrics also written to ``out/metrics.json``."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    if target is None:
        target, tokenizer = load_model(config.target, config.dtype, config.device, weights=None)
    target.requires_grad_(False)
    if train_data is None:
        train_data = load_data(config.data, tokenizer, "train", config.max_tokens, config.limit)
    if eval_data is None:
        eval_data = load_data(config.eval_data, tokenizer, "held_out", config.max_tokens)
    if len(eval_data) > config.eval_sequences:
        eval_data = eval_data.subset(range(config.eval_sequences))

    objective = make_objective(config, target, train_data, tokenizer)
    vocab = getattr(objective, "vocab", None)
    vocab_ids = vocab.target_ids.tolist() if vocab is not None else None
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
        if state.get("vocab") != vocab_ids:
            raise ValueError(f"{checkpoint} was trained with another draft vocabulary: use a new --out folder")
        objective.load(state["weights"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step, trained_tokens, elapsed = state["step"], state["tokens"], state["elapsed"]

    def save_checkpoint() -> None:
        state = {"kind": config.kind, "vocab": vocab_ids, "weights": objective.trainable(),
                 "optimizer": optimizer.state_dict(),
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
            for tokens, lengths, loss_from in padded_batches(train_data, config.batch_size, config.seed, epoch):
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
                tokens, lengths, loss_from = (t.to(target.device) for t in (tokens, lengths, loss_from))
                with autocast:
                    loss, agreement = objective.loss(tokens, lengths, loss_from)
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
    by_step = evaluate(objective, eval_data, config.batch_size, autocast)
    metrics = {"kind": config.kind, "steps": step, "total_steps": total_steps, "trained_tokens": trained_tokens,
               "train_seconds": round(elapsed + time.perf_counter() - start, 1),
               "finished": step >= total_steps, "draft_vocab": len(vocab) if vocab is not None else None,
               "held_out_top1_agreement": by_step[0]["top1"] if by_step else None,
               "held_out_sequences": len(eval_data), "held_out_by_step": by_step,
               "config": dataclasses.asdict(config)}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
