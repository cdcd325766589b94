"""Self-distillation data: the target's own answers to training prompts.

A drafter's job is to predict this target, not whoever wrote a dataset's
answers; trained on the target's own text it sees exactly what it will have to
draft. Each prompt is answered once per temperature (0 = greedy; sampled ones
show the drafter the target's other likely continuations), with the project's
batched decoding (``core.engine.Engine``, AR rows, continuous batching).

Prompts are split into shards; each finished shard is written at once as
``answers-t<temperature>-<shard>.npz`` (a ``TokenDataset`` of prompt + answer,
with ``loss_from`` at the answer's start), so an interrupted run resumes at the
first missing shard and several processes can share the shards
(``worker=(i, n)``). ``settings.json`` records how the answers were made; a
folder refuses a run with other settings.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from ..core.config import DecodeConfig
from ..core.engine import Engine, Job, Row, admit
from ..core.sampling import Sampling
from ..data import TokenDataset
from ..files import write_whole
from ..loading import shared_vocab_size


@dataclass(frozen=True)
class AnswerSettings:
    """How the answers are made."""

    temperatures: tuple[float, ...] = (0.0, 0.8)
    max_new_tokens: int = 256
    max_prompt_tokens: int = 256  # longer prompts are skipped, not cut
    shard_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperatures or any(not t >= 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
        for name in ("max_new_tokens", "max_prompt_tokens", "shard_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def encode_prompts(tokenizer, prompts: list, max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of each prompt (a user message, or chat messages) with the chat template's generation
    prompt; prompts longer than ``max_prompt_tokens`` are dropped."""
    encoded = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        if len(ids) <= max_prompt_tokens:
            encoded.append([int(t) for t in ids])
    return encoded


def training_prompts(source: str, limit: int | None = None, split: str = "train") -> list:
    """Prompts to answer: ``sharegpt`` (the first user message of each conversation of that split; held-out
    conversations never reach training) or a JSONL file of ``prompt``/``messages`` rows."""
    if source == "sharegpt":
        from .. import data

        train, held_out = data.split(data.read_sharegpt())
        chosen = train if split == "train" else held_out
        return data.prompts(chosen, limit if limit is not None else len(chosen), max_chars=4000)
    from ..eval.tasks import FreeForm

    return [example.prompt for example in FreeForm(source).examples(limit)]


def _shard_path(folder: Path, temperature: float, shard: int) -> Path:
    return folder / f"answers-t{temperature:g}-{shard:05d}.npz"


def _check_settings(folder: Path, settings: AnswerSettings, prompts: list[list[int]]) -> None:
    """Write ``settings.json``, or refuse a folder whose answers were made otherwise."""
    record = dataclasses.asdict(settings) | {"prompts": len(prompts),
                                             "prompt_tokens": sum(len(p) for p in prompts)}
    record["temperatures"] = list(settings.temperatures)
    path = folder / "settings.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved != record:
            differ = {k: (saved.get(k), v) for k, v in record.items() if saved.get(k) != v}
            raise ValueError(f"{folder} holds answers made with other settings (saved, asked): {differ}; "
                             "use another folder")
        return
    write_whole(path, lambda partial: partial.write_text(json.dumps(record, indent=2)))  # workers may start together


@torch.inference_mode()
def generate_answers(target: PreTrainedModel, prompts: list[list[int]], folder: str | Path,
                     settings: AnswerSettings, eos_token_ids: tuple[int, ...], batch_size: int = 64,
                     worker: tuple[int, int] = (0, 1), progress: bool = True) -> int:
    """Answer every prompt (token ids) at every temperature into ``folder``; returns the answers written now.

    Shards already on disk are skipped; worker i of n takes the shards s with s % n == i. Rows are
    seeded by (seed, prompt index, temperature), so an answer does not depend on its batch.
    """
    index, count = worker
    if not 0 <= index < count:
        raise ValueError(f"worker must be i/n with 0 <= i < n, got {index}/{count}")
    folder = Path(folder)
    _check_settings(folder, settings, prompts)
    shards = range(0, (len(prompts) + settings.shard_size - 1) // settings.shard_size)
    todo = [(t, s) for s in shards if s % count == index for t in settings.temperatures
            if not _shard_path(folder, t, s).exists()]
    total = sum(len(prompts[s * settings.shard_size:(s + 1) * settings.shard_size]) for _, s in todo)
    bar = tqdm(total=total, desc="answers", unit="answer", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    written = 0
    for temperature, shard in todo:
        first = shard * settings.shard_size
        chunk = prompts[first:first + settings.shard_size]
        configs = [DecodeConfig(method="ar", sampling=Sampling(temperature=temperature),
                                max_new_tokens=settings.max_new_tokens, eos_token_ids=eos_token_ids,
                                seed=(settings.seed * 1_000_003 + first + i) * 101 + int(temperature * 100))
                   for i in range(len(chunk))]
        answers = _answer(target, chunk, configs, batch_size, bar)
        dataset = TokenDataset.from_sequences([p + a for p, a in zip(chunk, answers)],
                                              {"temperature": temperature, "shard": shard},
                                              [len(p) for p in chunk])
        write_whole(_shard_path(folder, temperature, shard), dataset.save)
        written += len(chunk)
    bar.close()
    return written


def _answer(target: PreTrainedModel, prompts: list[list[int]], configs: list[DecodeConfig], batch_size: int,
            bar: tqdm) -> list[list[int]]:
    """Decode ``prompts`` with up to ``batch_size`` rows at a time; new rows join as old ones finish."""
    engine = Engine(target, shared_vocab_size(target))
    jobs = deque(Job(torch.tensor([prompt], device=engine.device), config) for prompt, config in zip(prompts, configs))
    order = {id(job): i for i, job in enumerate(jobs)}
    rows: list[Row | None] = [None] * len(prompts)

    def take(count: int) -> list[Job]:
        return [jobs.popleft() for _ in range(min(count, len(jobs)))]

    while jobs or engine.rows:
        for job, row in admit(engine, take, batch_size, group=max(1, batch_size // 4)):
            rows[order[id(job)]] = row
        bar.update(len(engine.step()))
    return [row.tokens for row in rows]


def load_answers(folder: str | Path) -> TokenDataset:
    """Every shard in ``folder``, ordered by shard then temperature, as one dataset."""
    folder = Path(folder)
    paths = sorted(folder.glob("answers-t*-*.npz"), key=lambda p: (p.stem.rsplit("-", 1)[1], p.stem))
    if not paths:
        raise ValueError(f"no answers in {folder}: make them with `fuzzyspec train data --out {folder}`")
    settings = json.loads((folder / "settings.json").read_text()) if (folder / "settings.json").exists() else {}
    return TokenDataset.concatenate([TokenDataset.load(p) for p in paths], {"answers": str(folder), **settings})
