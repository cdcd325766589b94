"""Accuracy-speed sweeps: run drafters x rules x divergences x thresholds on a task, one row each.

A sweep lives in one folder. Every finished example is appended to ``generations/<row>.jsonl``
(completion, counters, timing, scores), so an interrupted sweep resumes where it stopped, example by
example, and adding thresholds to a finished sweep runs only the new rows. After each row the folder's
``results.csv``, ``results.json`` and ``curve.png`` are rewritten from everything finished so far.

Several processes (on machines sharing the folder) can split a sweep: worker i of n decodes the examples
whose index % n == i in every row and appends only to files of its own (``generations/<row>.w<i>of<n>.jsonl``,
``greedy_reference.w<i>of<n>.jsonl``). Everything is read from every worker's files: an example any of them
finished is done, a row is finished when all of its examples are, and its figures sum over all of them.

Under ``torchrun`` with a sharded target (``Sweep(..., sharded=True)``, ``bench --tp``) the ranks are one
worker: every rank loads its share of the target and makes the same decoding calls, while rank 0 alone reads
and writes the folder and tells the others what it found there (rows, finished examples, thresholds).

Speed is new tokens / seconds inside the decoding loop, summed over examples; scoring (running
HumanEval tests, the target's NLL, agreement with its greedy output) happens outside the timed part.
Every example is decoded with seed = sweep seed + its index, the same in every row.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch
from tqdm.auto import tqdm

from ..api import ModelPair, Result
from ..core import parallel
from ..core.config import DecodeConfig
from ..files import write_whole
from ..loading import EMBEDDED
from ..options import BY_NAME, FUZZY
from ..tuning import prepare
from .calibrate import CALIBRATION_PROMPTS, CALIBRATION_TOKENS, calibrate_pair
from .quality import greedy_agreement, target_nll
from .tasks import Example, Task, get_task

TREE_SUFFIX = "+tree"  # a drafter "eagle+tree" drafts EAGLE-2 trees with the head "eagle"
COUNTERS = ("new_tokens", "target_forwards", "accepted", "proposed", "wall_s")
SETTINGS_FILE = "sweep.json"  # what makes a folder a sweep folder
T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    """What every row of a sweep shares; a sweep folder holds rows of one Settings only. ``decoding`` holds
    the decoding options every row shares (``options.OPTIONS`` names: gamma, sampling, length, seed, ...)."""

    task: str
    data: str | None = None
    limit: int | None = None
    target: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    weights: str = "auto"
    compile: bool = False
    calibration_prompts: int = CALIBRATION_PROMPTS
    calibration_tokens: int = CALIBRATION_TOKENS
    decoding: dict = field(default_factory=lambda: {"seed": 0, "max_new_tokens": 256})

    def option(self, name: str):
        """A decoding option: the sweep's, else its default."""
        return self.decoding.get(name, BY_NAME[name].default)


@dataclass(frozen=True)
class Spec:
    """One row: a drafter (``draft``, by registry name; "ar" for none) and a rule with its divergence and
    threshold. A row may name ``target_acceptance`` instead of a threshold; T is then calibrated first."""

    draft: str
    rule: str
    divergence: str | None = None
    threshold: float | None = None
    target_acceptance: float | None = None

    @property
    def key(self) -> str:
        parts = [self.draft, self.rule]
        if self.rule in FUZZY:
            parts += [self.divergence or "", f"acc={self.target_acceptance:g}" if self.threshold is None
                      else f"T={self.threshold:g}"]
        return " ".join(parts)

    @property
    def stem(self) -> str:
        """The name of the row's generation files: ``<stem>.jsonl``, or a worker's ``<stem>.w<i>of<n>.jsonl``."""
        return re.sub(r"[^A-Za-z0-9=.+-]+", "_", self.key)


def plan(drafts: list[str], rules: list[str], divergences: list[str], thresholds: list[float],
         target_acceptances: list[float] = ()) -> list[Spec]:
    """The rows of a sweep, AR first, then per drafter its SD row and its fuzzy rows."""
    specs = [Spec("ar", "ar")] if "ar" in drafts else []
    for draft in (d for d in drafts if d != "ar"):
        if "sd" in rules:
            specs.append(Spec(draft, "sd"))
        for rule in (r for r in rules if r in FUZZY):
            for divergence in divergences:
                specs += [Spec(draft, rule, divergence, t) for t in thresholds]
                specs += [Spec(draft, rule, divergence, target_acceptance=a) for a in target_acceptances]
    unknown = set(rules) - {"sd", *FUZZY}
    if unknown:
        raise ValueError(f"unknown rule(s) {', '.join(sorted(unknown))}; valid: sd, {', '.join(FUZZY)}")
    if not specs:
        raise ValueError("the sweep is empty: give --drafts ar and/or a drafter with --rules")
    return specs


def hardware(device: str, shards: int = 1) -> str:
    """A short description of what the numbers were measured on: the CPU (and its instruction sets), threads,
    the GPU where one is used, and the ranks a sharded target spans."""
    from ..tuning import machine

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}; {machine(device)}"
    return text + (f"; target sharded over {shards} ranks" if shards > 1 else "")


def _read_jsonl(path: Path) -> Iterator[dict]:
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:  # a line cut by an interruption: redo that example
                    continue


def _append_jsonl(path: Path, record: dict) -> None:
    """Append one record as a line. A last line cut by an interruption is ended first, so it stays one bad
    line (skipped when read, its example redone) instead of gluing onto this record."""
    with path.open("a+b") as file:
        file.seek(0, 2)
        if file.tell():
            file.seek(-1, 2)
            if file.read(1) != b"\n":
                file.write(b"\n")
        file.write((json.dumps(record) + "\n").encode())


def _read_json(path: Path, default: Any) -> Any:
    return json.loads(path.read_text()) if path.is_file() else default


def _write_json(path: Path, value: Any, indent: int = 2) -> None:
    write_whole(path, lambda temp: temp.write_text(json.dumps(value, indent=indent) + "\n"))


def _worker_files(folder: Path, stem: str) -> list[Path]:
    """``stem.jsonl`` and every worker's ``stem.w<i>of<n>.jsonl`` in ``folder``, in name order (the plain
    file first): the one order in which duplicates are resolved, whichever process reads them."""
    pattern = re.compile(re.escape(stem) + r"(\.w\d+of\d+)?\.jsonl")
    return sorted(p for p in folder.iterdir() if pattern.fullmatch(p.name)) if folder.is_dir() else []


def _first_by_id(paths: list[Path]) -> dict[str, dict]:
    """The records of these files by example id; an example found twice (finished by two workers, or again by
    a rerun with another worker count) counts once, as its first record."""
    records: dict[str, dict] = {}
    for path in paths:
        for record in _read_jsonl(path):
            records.setdefault(record["id"], record)
    return records


@dataclass
class Sweep:
    """A sweep folder: its settings, the loaded models, and the rows run so far. ``worker`` (i, n): this
    process decodes the examples whose index % n == i, so that every worker's timing covers every row.
    ``sharded``: this process is one rank of a ``torchrun`` launch sharing a tensor-parallel target; the
    launch's ranks together are one worker, and rank 0 alone touches the folder."""

    settings: Settings
    out: Path
    progress: bool = True
    worker: tuple[int, int] = (0, 1)
    sharded: bool = False
    leads: bool = field(init=False)  # reads and writes the folder and shows progress: not a follower rank
    task: Task = field(init=False)
    examples: list[Example] = field(init=False)
    _pairs: dict[str, ModelPair] = field(init=False, default_factory=dict)
    _warm: set[str] = field(init=False, default_factory=set)
    _ids: dict[str, torch.Tensor] = field(init=False, default_factory=dict)
    _hardware: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        index, count = self.worker
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"worker must be i/n with 0 <= i < n, got {index}/{count}")
        self.out = Path(self.out)
        if self.sharded:
            parallel.start(self.settings.device)
        self.leads = not self.sharded or parallel.rank() == 0
        self.progress = self.progress and self.leads
        self._on_leader(self._check_settings)
        self.task = get_task(self.settings.task, self.settings.data)
        self.examples = self.task.examples(self.settings.limit)
        if not self.examples:
            raise ValueError(f"task {self.settings.task!r} has no examples")

    @classmethod
    def from_folder(cls, out: str | Path, progress: bool = False) -> Sweep:
        """The sweep a folder holds, with the settings saved there (to merge its workers' results)."""
        return cls(Settings(**json.loads((Path(out) / SETTINGS_FILE).read_text())), out, progress)

    def _on_leader(self, work: Callable[[], T]) -> T:
        """``work()`` (which reads or writes the folder and makes no collective call): done here, or where the
        target is sharded, done by rank 0 and its result (or the error it raised) given to every rank."""
        if not self.sharded:
            return work()
        outcome: tuple[Any, BaseException | None] | None = None
        if self.leads:
            try:
                outcome = (work(), None)
            except (ValueError, OSError) as error:
                outcome = (None, error)
        value, error = parallel.agree(outcome)
        if error is not None:
            raise error
        return value

    def _check_settings(self) -> None:
        mine = dataclasses.asdict(self.settings)
        path = self.out / SETTINGS_FILE
        theirs = _read_json(path, None)
        if theirs is not None:
            flat = {k: v for k, v in mine.items() if k != "decoding"} | mine["decoding"]  # name the option itself
            saved = {k: v for k, v in theirs.items() if k != "decoding"} | (theirs.get("decoding") or {})
            differ = sorted(k for k in flat.keys() | saved.keys() if saved.get(k) != flat.get(k))
            if differ:
                raise ValueError(f"{self.out} holds a sweep with other settings ({', '.join(differ)} differ): "
                                 f"use another --out")
        (self.out / "generations").mkdir(parents=True, exist_ok=True)
        if theirs is None:  # workers starting together may each write it: the same text, renamed into place
            _write_json(path, mine)

    def _own(self, folder: Path, stem: str) -> Path:
        """This worker's file ``stem`` in ``folder``: the plain name for a sweep in one process."""
        index, count = self.worker
        return folder / (f"{stem}.jsonl" if count == 1 else f"{stem}.w{index}of{count}.jsonl")

    # -- models -------------------------------------------------------------------------------------
    def pair(self, draft: str) -> ModelPair:
        """The target with the drafter ``draft`` names (one target in memory for all of them)."""
        name = draft.removesuffix(TREE_SUFFIX)
        if name not in self._pairs:
            s = self.settings
            if not self._pairs:
                base = ModelPair.load(s.target, None, s.dtype, s.device, s.weights, s.compile, tp=self.sharded)
                self._pairs["ar"] = base
            base = self._pairs["ar"]
            if name != "ar":
                self._pairs[name] = base.with_drafter(name, s.target, s.dtype, s.device, s.weights)
        return self._pairs[name]

    def ids(self, example: Example) -> torch.Tensor:
        if example.id not in self._ids:
            self._ids[example.id] = self.pair("ar").encode(example.prompt)
        return self._ids[example.id]

    def config(self, spec: Spec, threshold: float | None, **overrides: Any) -> DecodeConfig:
        """The row's decoding: the sweep's options, the row's rule, and trees where the drafter's name asks
        for them (``+tree``; the default drafter drafts them anyway, as the default job does). A row drafts
        its full size every step unless the sweep asks for a schedule: a curve compares rules at fixed draft
        sizes, and the cost schedule would turn rows that do not pay on this machine into AR."""
        options = {"gamma_schedule": "constant"} | dict(self.settings.decoding, method=spec.rule)
        if spec.draft.endswith(TREE_SUFFIX):
            options["tree"] = True
        if spec.rule in FUZZY:
            options.update(divergence=spec.divergence, threshold=threshold)
        return self.pair(spec.draft).config(**(options | overrides))

    def generate(self, spec: Spec, ids: torch.Tensor, config: DecodeConfig) -> Result:
        return self.pair(spec.draft).generate(ids, stop=self.task.stop, config=config)

    # -- thresholds ---------------------------------------------------------------------------------
    def threshold(self, spec: Spec) -> float | None:
        """The row's T: given, or calibrated on the first examples (and remembered in calibrations.json)."""
        if spec.rule not in FUZZY or spec.threshold is not None:
            return spec.threshold
        path = self.out / "calibrations.json"
        known = self._on_leader(lambda: _read_json(path, {}).get(spec.key))
        if known is None:
            s = self.settings
            config = self.config(spec, 0.0, max_new_tokens=s.calibration_tokens, seed=s.option("seed"))
            sample = [e.prompt for e in self.examples[: s.calibration_prompts]]
            found = calibrate_pair(self.pair(spec.draft), config, "acceptance", spec.target_acceptance,
                                   sample, self.task.stop, self.progress).to_dict()

            def keep() -> dict:  # read again: a T another worker saved meanwhile wins, so a row shares one T
                saved = _read_json(path, {})
                saved.setdefault(spec.key, found)
                _write_json(path, saved)
                return saved[spec.key]

            known = self._on_leader(keep)
        return known["threshold"]

    # -- rows ---------------------------------------------------------------------------------------
    def _is_greedy_ar(self, spec: Spec) -> bool:
        return spec.rule == "ar" and self.settings.option("temperature") == 0

    def references(self, specs: list[Spec], todo: dict[str, list[tuple[int, Example]]]) -> dict[str, list[int]]:
        """The target's greedy output for the examples this worker will decode (for agreement), kept on disk
        and read from every worker's file. A greedy AR row produces it anyway (and runs first), so only what
        no such row of this worker will produce is computed here."""
        known = self._on_leader(lambda: {id_: r["tokens"] for id_, r in
                                         _first_by_id(_worker_files(self.out, "greedy_reference")).items()})
        coming = {e.id for spec in specs if self._is_greedy_ar(spec) for _, e in todo[spec.key]}
        needed = {e.id for pairs in todo.values() for _, e in pairs}
        spec = Spec("ar", "ar")
        missing = [e for e in self.examples if e.id in needed and e.id not in known and e.id not in coming]
        for example in tqdm(missing, desc="greedy reference", leave=False, disable=not self.progress):
            config = self.config(spec, None, temperature=0.0, top_k=0, top_p=1.0, seed=0)
            self._remember(known, example.id, self.generate(spec, self.ids(example), config).tokens)
        return known

    def _remember(self, references: dict[str, list[int]], example_id: str, tokens: list[int]) -> None:
        if example_id not in references:
            references[example_id] = tokens
            if self.leads:
                _append_jsonl(self._own(self.out, "greedy_reference"), {"id": example_id, "tokens": tokens})

    def _all_specs(self, specs: list[Spec]) -> list[Spec]:
        """These rows after every row an earlier run of this folder asked for (kept in specs.json), so
        that the folder's results always hold all of its rows; a greedy AR row first, so that its outputs
        can serve as the greedy reference."""
        path = self.out / "specs.json"
        while True:  # until the file holds these rows: a worker starting beside this one may replace it
            known = [Spec(**spec) for spec in _read_json(path, [])]
            merged = list({spec.key: spec for spec in known + specs}.values())
            if merged == known:
                return sorted(merged, key=lambda spec: not self._is_greedy_ar(spec))
            _write_json(path, [dataclasses.asdict(spec) for spec in merged], indent=1)

    def _done(self, specs: list[Spec]) -> dict[str, dict[str, dict]]:
        """Every worker's finished examples, per row: {row key: {example id: record}}."""
        return {spec.key: _first_by_id(_worker_files(self.out / "generations", spec.stem)) for spec in specs}

    def run(self, specs: list[Spec]) -> list[dict]:
        """Run this worker's share of every row not yet finished by any worker (with one progress bar over all
        of it); return all the folder's finished rows, every worker's included (on a sharded target's rank 0;
        nothing on its other ranks)."""
        specs = self._on_leader(lambda: self._all_specs(specs))
        done = self._on_leader(lambda: {key: set(records) for key, records in self._done(specs).items()})
        index, count = self.worker
        todo = {spec.key: [(i, e) for i, e in enumerate(self.examples) if i % count == index
                           and e.id not in done[spec.key]] for spec in specs}
        total = sum(map(len, todo.values()))
        references = self.references(specs, todo) if self.task.compare_to_greedy and total else None
        name = "bench" if count == 1 else f"bench {index}/{count}"
        bar = tqdm(total=total, desc=name, unit="example", disable=not self.progress)
        for spec in specs:
            if not todo[spec.key]:
                continue
            bar.set_description(spec.key if count == 1 else f"{spec.key} [{index}/{count}]")
            threshold = self.threshold(spec)
            self._warm_up(spec, threshold)
            path = self._own(self.out / "generations", spec.stem)
            for example_index, example in todo[spec.key]:
                record = self._run_example(spec, threshold, example_index, example, references)
                if self.leads:
                    _append_jsonl(path, record)
                bar.update()
            if self.leads:
                self.merge()
        bar.close()
        return self.merge() if self.leads else []

    def merge(self) -> list[dict]:
        """Rewrite results.csv, results.json and curve.png from every worker's records; return the finished
        rows. Workers finishing together may each read before the other's last record and write after it,
        so the files are read again after writing, until no row finished meanwhile: whoever writes last
        has read everything."""
        specs = self._all_specs([])
        rows: list[dict] = []
        written: list[Spec] | None = None
        while True:
            done = self._done(specs)
            finished = [s for s in specs if all(e.id in done[s.key] for e in self.examples)]
            if finished == written:
                return rows
            rows = self.write(finished, done)
            written = finished

    def _warm_up(self, spec: Spec, threshold: float | None) -> None:
        """One short untimed call per drafter, after compiling (where compiled) every one-row shape its drafts
        may take, so the first timed example pays no one-off costs."""
        if spec.draft in self._warm:
            return
        config = self.config(spec, threshold, max_new_tokens=8, seed=0)
        prepare(self.pair(spec.draft), config)
        self.generate(spec, self.ids(self.examples[0]), config)
        self._warm.add(spec.draft)

    def _run_example(self, spec: Spec, threshold: float | None, index: int, example: Example,
                     references: dict[str, list[int]] | None) -> dict:
        ids = self.ids(example)
        config = self.config(spec, threshold, seed=self.settings.option("seed") + index)
        result = self.generate(spec, ids, config)
        stats = result.stats
        pair = self.pair(spec.draft)
        nll = target_nll(pair.target, ids, result.tokens, pair.vocab_size)  # every rank: the target's pass
        if references is not None and self._is_greedy_ar(spec):
            self._remember(references, example.id, result.tokens)
        if not self.leads:  # rank 0 scores and keeps the record (scoring may run the completion's code)
            return {}
        scores = dict(self.task.score(example, result.text)) | {"nll": nll}
        if references is not None:
            scores |= greedy_agreement(result.tokens, references[example.id])
        if self._hardware is None:
            self._hardware = hardware(self.settings.device, pair.step.shards)
        return {"id": example.id, "completion": result.text, "finish_reason": result.finish_reason,
                "threshold": threshold, **{k: getattr(stats, k) for k in COUNTERS}, "scores": scores,
                "hardware": self._hardware}

    def row(self, spec: Spec, records: list[dict]) -> dict:
        """One CSV/JSON row: the configuration, the task's metrics (means over examples) and the speed."""
        s = self.settings
        total = {k: sum(r[k] for r in records) for k in COUNTERS}
        # What the timings were measured on (workers may have run on different machines), not what merges.
        measured = " | ".join(dict.fromkeys(r.get("hardware") or hardware(s.device) for r in records))
        names = sorted({k for r in records for k in r["scores"]}, key=lambda k: (k != self.task.metric, k))
        metrics = {}
        for name in names:
            values = [r["scores"][name] for r in records if r["scores"].get(name) is not None]
            metrics[name] = sum(values) / len(values) if values else None
        return {
            "task": self.task.name, "metric": self.task.metric, "draft": spec.draft, "rule": spec.rule,
            "divergence": spec.divergence, "threshold": records[0]["threshold"],
            "target_acceptance": spec.target_acceptance, **metrics,
            "tokens_per_s": total["new_tokens"] / total["wall_s"] if total["wall_s"] else 0.0,
            "mean_accepted": total["new_tokens"] / max(total["target_forwards"], 1),
            "acceptance_rate": total["accepted"] / total["proposed"] if total["proposed"] else None,
            "target_forwards": total["target_forwards"], "new_tokens": total["new_tokens"],
            "prompts": len(records), "seed": s.option("seed"), "target": s.target or EMBEDDED,
            "dtype": s.dtype, "weights": s.weights, "compiled": s.compile, "device": s.device, "temperature": s.option("temperature"), "top_k": s.option("top_k"),
            "top_p": s.option("top_p"), "gamma": s.option("gamma"), "max_new_tokens": s.option("max_new_tokens"), "hardware": measured, "key": spec.key,
        }

    def write(self, specs: list[Spec], done: dict[str, dict[str, dict]]) -> list[dict]:
        """Rewrite results.csv, results.json and curve.png from the finished rows (records in example order,
        whichever worker wrote them)."""
        from .plot import plot_curve  # matplotlib loads only when there is something to draw

        ids = [e.id for e in self.examples]
        rows = [self.row(spec, [done[spec.key][i] for i in ids]) for spec in specs]
        if not rows:
            return rows
        table = io.StringIO(newline="")
        writer = csv.DictWriter(table, list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)
        write_whole(self.out / "results.csv", lambda temp: temp.write_text(table.getvalue(), newline=""))
        _write_json(self.out / "results.json", {"settings": dataclasses.asdict(self.settings), "rows": rows})
        title = f"{self.task.name}, {len(self.examples)} examples, {rows[0]['target']}\n{rows[0]['hardware']}"
        write_whole(self.out / "curve.png", lambda temp: plot_curve(rows, temp, self.task.metric,
                                                                 self.task.higher_is_better, title=title))
        return rows
