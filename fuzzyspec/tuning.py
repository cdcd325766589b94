"""What this machine charges for a target's steps and a drafter's proposals: profiles, kept in the cache.

A profile (``core.cost.Profile``) is kept per target, weights form, dtype, device, CPU instruction set, thread
count, torch version and compilation, in ``profiles.json`` in the fuzzyspec cache (or the file
``$FUZZYSPEC_PROFILES`` names). The engine folds in what it measures as it decodes, and a pair saves it;
``measure`` (``fuzzyspec tune``) measures every width ahead of time, each drafter's proposals, and compiled steps
beside eager ones with their compile times, so that the choice of draft sizes and of compiling is informed from
the first token.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from .core import kernels
from .core.cost import OUTSIDE, TARGET, Acceptance, Option, Profile, draft_key, speedup, widened
from .core.kvcache import HEAD_CAPACITY, StaticCache, attention_mask, chain_tree, write_positions
from .core.step import TargetStep
from .files import write_whole
from .loading import EMBEDDED, cache_dir, cpu_isa, resolve_dtype, weight_form

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 17, 24, 32)
# A drafted token that got there passes this much less often than the one before it: the shipped EAGLE head's
# greedy chains of 4 on 24 everyday prompts passed 0.48 at the first draft, then 0.40, 0.41 and 0.29 of those that
# got there (benchmarks/results_draft_confidence_epyc_2026-11-27.txt)
LATER_DEPTHS = 0.85


def machine(device: str = "cpu") -> str:
    """One line saying what the numbers were measured on."""
    text = f"{platform.machine()} [{cpu_isa()}], {torch.get_num_threads()} threads, torch {torch.__version__}"
    if device.startswith("cuda") and torch.cuda.is_available():
        text = f"{torch.cuda.get_device_name()}; {text}"
    return text


def profile_key(target: str | None, weights: str, dtype: str, device: str, compiled: bool,
                shards: int = 1) -> str:
    """Where the costs of a target loaded with these options are kept: decided from the options as loading
    decides the weights form (``int4`` or the torch dtype), so it is known before anything loads. A target
    sharded over ``shards`` tensor-parallel ranks has its own profile (its steps pay for collectives)."""
    form = weight_form(target, weights, dtype, device)
    form = f"int4 ({kernels.isa()})" if form == "int4" else str(resolve_dtype(form, device))
    sharded = [f"tp={shards}"] if shards > 1 else []
    return "|".join([str(target or EMBEDDED), form, device, *_here(), *sharded, "compiled" if compiled else "eager"])


def weights_key(target: str | None, device: str) -> str:
    """Where ``fuzzyspec tune`` notes which weights form runs a GGUF target's step fastest on this machine."""
    return "|".join([str(target or EMBEDDED), "weights", device, *_here()])


def _here() -> tuple[str, ...]:
    """What about this machine, process and code a measurement depends on: instruction sets, threads, torch, and
    the code that runs a step (a cost measured before it changed would be kept otherwise: the schedule
    re-measures only the sizes it runs, so a stale dear width would never be tried again)."""
    return cpu_isa(), f"threads={torch.get_num_threads()}", f"torch={torch.__version__}", f"step={_step_code()}"


@functools.cache
def _step_code() -> str:
    """A digest of the sources that decide what a target step costs, and how its costs are estimated."""
    core = Path(__file__).parent / "core"
    sources = [core / name for name in ("step.py", "kvcache.py", "int4.py", "int4_kernel.cpp", "attention.py",
                                        "layer_kernel.cpp", "ops.cpp", "kernels.h", "cost.py", "engine.py")]
    return hashlib.sha256(b"".join(source.read_bytes() for source in sources)).hexdigest()[:8]


def profile_path() -> Path:
    """``$FUZZYSPEC_PROFILES``, else ``profiles.json`` in the fuzzyspec cache."""
    return Path(os.environ.get("FUZZYSPEC_PROFILES") or cache_dir() / "profiles.json")


def _saved() -> dict:
    """Every key's entry in ``profiles.json`` (nothing where it is missing or unreadable)."""
    try:
        return json.loads(profile_path().read_text())
    except (OSError, ValueError):
        return {}


# How long a profile measured by other code (another step digest, ``_here``) is kept: another fuzzyspec version
# sharing the cache keeps its own while it is in use, and an upgrade's old profiles go. They are never read again,
# and every answer's ``save`` reads and writes the file whole: after a few days of changes one machine's file held
# 425 profiles (232 KB), and keeping a profile took 12 ms of each answer (2026-11-26, a 2-core EPYC).
STALE_S = 7 * 24 * 3600


def _write(saved: dict) -> None:
    """Write ``profiles.json`` whole, then rename it into place (a reader never sees half a file), less the
    profiles of other code not written for ``STALE_S``."""
    mine, since = f"step={_step_code()}", time.time() - STALE_S
    kept = {key: entry for key, entry in saved.items()
            if mine in key.split("|") or (isinstance(entry, dict) and entry.get("written", 0.0) > since)}
    # (on one line: an indented dump goes through json's pure-Python encoder, 4.6 ms against 1.1 for a machine's
    # 36 profiles, at every answer)
    text = json.dumps(kept, separators=(",", ":")) + "\n"
    write_whole(profile_path(), lambda partial: partial.write_text(text))


def load(key: str) -> Profile:
    """The profile saved under ``key`` (an empty one where none is)."""
    return Profile.from_dict(_saved().get(key, {}))


def save(key: str, profile: Profile) -> None:
    """Keep ``profile`` under ``key`` (its facts and the other keys kept)."""
    saved = _saved()
    saved[key] = saved.get(key, {}) | profile.to_dict() | {"written": time.time()}
    _write(saved)
    profile.updates = 0


def note(key: str, **facts: object) -> None:
    """Record facts beside a profile (what compiling was measured to gain)."""
    saved = _saved()
    saved.setdefault(key, {}).update(facts, written=time.time())
    _write(saved)


def facts(key: str) -> dict:
    return _saved().get(key, {})


@torch.inference_mode()
def measure_target(step: TargetStep, widths: tuple[int, ...] = WIDTHS, prefix: int = 128, rounds: int = 15,
                   compiled: bool = False, progress: Callable[[str], None] | None = None, capacity: int | None = None
                   ) -> tuple[dict[int, float], dict[int, float]]:
    """Milliseconds of one forward of ``width`` tokens after ``prefix`` cached ones, for each width (batch 1,
    a cache of ``capacity`` positions, by default the one decoding starts with): the median over ``rounds`` rounds,
    each of which runs every width once, in an order turned a step each round; and, compiled, the seconds of each
    width's first call (its compilation, or loading it from the cache).

    Why rounds: a spell of the machine's pace then falls on every width alike. Timed one width after another (five
    calls each), a compiled 2-token pass of the embedded 4-bit target came out at 0.82x, 0.91x, 1.18x and 1.13x a
    1-token one in four runs right after loading, on a 2-core EPYC; in rounds, 1.02x-1.05x; 300 rounds of the two
    widths alone, 1.06x (in a calm spell later, both ways gave 1.01x-1.08x: ``benchmarks/ab_tune_widths.py``). A
    ``fuzzyspec tune`` that had settled 1.25x there left the planner drafting only from a first-draft acceptance near
    the shipped head's own (about 0.48), so whether the default job drafted at all was left to chance (2026-11-27)."""
    runs, compile_s = target_calls(step, widths, prefix, compiled, progress, capacity)
    times: dict[int, list[float]] = {width: [] for width in widths}
    for round_ in range(rounds):
        for width in widths[round_ % len(widths):] + widths[: round_ % len(widths)]:
            clock = time.perf_counter()
            runs[width]()
            times[width].append(1000 * (time.perf_counter() - clock))
    return {width: statistics.median(ms) for width, ms in times.items()}, compile_s


@torch.inference_mode()
def target_calls(step: TargetStep, widths: tuple[int, ...], prefix: int = 128, compiled: bool = False,
                 progress: Callable[[str], None] | None = None, capacity: int | None = None
                 ) -> tuple[dict[int, Callable[[], None]], dict[int, float]]:
    """For each width, a call of one forward of ``width`` tokens after ``prefix`` cached ones (batch 1, a cache of
    ``capacity`` positions), made twice already (its first call, compiled: its compilation; and one to warm it);
    and, compiled, the seconds of each first call. Run the calls under ``torch.inference_mode``, as they were made."""
    model = step.model
    device = model.get_input_embeddings().weight.device
    cache = StaticCache.for_model(model.config, 1, capacity or step.min_capacity, step.cache_dtype, device)
    longest = max(step.shape(width, 1)[0] for width in widths)
    tokens = torch.randint(0, model.config.vocab_size, (1, prefix + longest), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    start = torch.zeros(1, dtype=torch.long, device=device)
    step(cache, tokens[:, :prefix], write_positions(start, prefix), write_positions(start, prefix),
         attention_mask(start, chain_tree(1, prefix, device), cache.capacity), None, 1)
    cache.lengths = [prefix]
    start = torch.tensor([prefix], device=device)
    runs: dict[int, Callable[[], None]] = {}
    compile_s: dict[int, float] = {}
    for width in widths:
        run_width, _ = step.shape(width, 1)
        feed = tokens[:, prefix: prefix + run_width]
        positions = write_positions(start, run_width)
        mask = attention_mask(start, chain_tree(1, run_width, device), cache.capacity)
        if progress is not None:
            progress(f"target step, {width} token{'s' if width > 1 else ''}" + (" (compiling)" if compiled else ""))

        def run(feed=feed, positions=positions, mask=mask) -> None:
            step(cache, feed, positions, positions, mask, None, 0, (), compiled=compiled)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        clock = time.perf_counter()
        run()
        if compiled:
            compile_s[width] = time.perf_counter() - clock
        run()
        runs[width] = run
    return runs, compile_s


def prepare(pair, config, capacities: tuple[int, ...] | None = None, progress: Callable[[str], None] | None = None
            ) -> None:
    """Where the pair's step is compiled and ``config`` (a ``DecodeConfig``) drafts, compile ahead every one-row
    shape its drafts can ask the step to verify at each cache capacity in ``capacities``, and the drafter's own
    compiled steps where it has some (an EAGLE head's: one graph a width serves every capacity of its cache): the
    cost schedule moves between draft sizes as its measurements come in, and a shape first met while decoding
    stops that row for the seconds a compilation takes. ``capacities``: the step's first (``TargetStep.min_capacity``)
    unless given."""
    if pair.step.compile and pair.draft is not None and config.method != "ar":
        widths = Option.of(pair.draft.name, config).widths()
        for capacity in capacities or (pair.step.min_capacity,):
            measure_target(pair.step, widths, rounds=1, compiled=True, progress=progress, capacity=capacity)
        if pair.draft.prepare is not None:
            compiling = None
            if progress is not None:
                progress("drafter step")
                compiling = lambda: progress("drafter step (compiling)")  # noqa: E731 (said only where it compiles)
            pair.draft.prepare(HEAD_CAPACITY, compiling)  # (a head's cache starts there whatever the target's holds)


def measure(pair, config, widths: tuple[int, ...] = WIDTHS, progress: Callable[[str], None] | None = None) -> dict:
    """Measure ``pair``'s profile ahead of decoding (``fuzzyspec tune``), into ``pair.step.profile`` as settled
    costs: the target's step at ``widths`` (compiled where the pair's step is), and the drafter's proposals at every
    size and breadth ``config`` (a ``DecodeConfig``) may draft (``options_of``). Returns the times: ``target_ms``,
    ``compile_s`` and ``draft_ms`` (per drafting key, per size)."""
    step = pair.step
    target_ms, compile_s = measure_target(step, widths, compiled=step.compile, progress=progress)
    step.profile.set_measured(TARGET, target_ms)
    if step.compile and pair.draft is not None:
        # Drafting is priced as compiled decoding runs it, so after what serve and bench do first: every shape its
        # drafts verify, and the EAGLE head's direct calls. Without them the head's calls went through dynamo: tune
        # priced a 1-token chain at 1.4-2.2 ms, and at 0.6 ms with them, as decoding's own profiles do (0.7-0.9 ms;
        # 2026-11-27, a 2-core EPYC)
        prepare(pair, config, progress=progress)
    options, draft_ms = options_of(pair, config), {}
    for breadth in sorted({k for option in options.values() for k in option.breadths()}):
        if progress is not None:
            progress(f"{pair.draft.name} drafting {'chains' if breadth == 1 else f'{breadth}-wide trees'}")
        cap = max(option.cap for option in options.values() if breadth in option.breadths())
        drafted = draft_key(pair.draft.name, breadth)
        draft_ms[drafted] = measure_drafter(pair, breadth, range(1, cap + 1))
        step.profile.set_measured(drafted, draft_ms[drafted])
    return {"target_ms": target_ms, "compile_s": compile_s, "draft_ms": draft_ms}


def options_of(pair, config) -> dict[str, Option]:
    """What ``pair``'s drafter may draft under ``config``: ``chains`` up to its gamma, and where the drafter drafts
    trees, ``trees`` up to its tree depth; nothing without a drafter."""
    if pair.draft is None:
        return {}
    options = {"chains": Option(pair.draft.name, config.gamma)}
    if pair.draft.drafts_trees:
        options["trees"] = Option(pair.draft.name, config.tree_depth, (config.tree_total_tokens, config.tree_top_k))
    return options


@torch.inference_mode()
def measure_drafter(pair, breadth: int, sizes: range, prompt: str = "Explain how a bicycle stays upright.",
                    repeats: int = 5) -> dict[int, float]:
    """Milliseconds that drafting each size (chain tokens, or tree depth) at ``breadth`` children per node (1:
    chains) adds to a step of the pair's target, priced as decoding prices it (``Engine._price``: all a step
    spends beyond its forward and beyond a step that drafts nothing), over ``repeats`` or more steps of
    decoding ``prompt`` at that size. Measured apart from the pair's profile, which only takes what a step that
    drafts nothing spends outside its forward where it had no figure for it (the planner adds it to every step)."""
    from .core.engine import decode

    kept, pair.step.profile = pair.step.profile, Profile()
    measuring = pair.step.profile
    try:
        ids = pair.encode(prompt)
        ar = pair.config(method="ar", max_new_tokens=2 * repeats, eos_token_ids=())
        decode(pair.step, None, ids, ar, pair.vocab_size)  # what a step that drafts nothing spends
        result = {}
        key = draft_key(pair.draft.name, breadth)
        for size in sizes:
            shape = {"tree": True, "tree_top_k": breadth, "tree_depth": size} if breadth > 1 else \
                {"tree": False, "gamma": size}
            config = pair.config(method="sd", gamma_schedule="constant", max_new_tokens=repeats * (size + 1) + 1,
                                 eos_token_ids=(), **shape)
            decode(pair.step, pair.drafter(config), ids, config, pair.vocab_size)
            if size in measuring.draft.get(key, {}):  # (not where every step compiled)
                result[size] = measuring.draft_ms(key, size)
        kept.set_measured(OUTSIDE, {rows: measuring.outside_ms(rows) for rows in measuring.outside
                                    if rows not in kept.outside})
        return result
    finally:
        pair.step.profile = kept


def outlook(profile: Profile, options: dict[str, Option], rates: tuple[float, ...] = (0.3, 0.5, 0.7, 0.9)
            ) -> dict[str, dict[float, tuple[tuple[int, int], float]]]:
    """Per option, at each first-draft acceptance of a chain ``rates`` (``_as_seen``): the draft (depth, breadth) the
    planner picks for one row, and the tokens per second over AR it expects of it (``cost.speedup``)."""
    return {name: {rate: speedup(option, _as_seen(rate, option), profile) for rate in rates}
            for name, option in options.items()}


def pays_from(profile: Profile, chains: Option) -> float | None:
    """The lowest first-draft acceptance (``_as_seen``, to within 0.005) at which the planner drafts at all, drafting
    ``chains`` (an option without trees); None where it never does. (Chains alone: where trees are allowed, a tree's
    acceptance is the prior's guess from a chain's, ``cost.widened``, and that guess would decide it.)"""
    def drafts(rate: float) -> bool:
        return speedup(chains, _as_seen(rate, chains), profile)[0] != (0, 1)

    if not drafts(1.0):
        return None
    low, high = 0.0, 1.0
    while high - low > 0.005:  # (a draft pays more the likelier it passes: one crossing)
        low, high = (low, (low + high) / 2) if drafts((low + high) / 2) else ((low + high) / 2, high)
    return round(high, 3)


def acceptance_met(profile: Profile, drafter: str, options: dict[str, Option], least: float = 20.0) -> dict[str, dict]:
    """What ``drafter``'s drafts met in the decoding this profile has seen (``Profile.population``, per rule), where
    at least ``least`` first drafts count: the first draft's acceptance, and per option (``picks``) the draft a new
    row starts from and the speed over AR the planner expects of it (``cost.speedup``)."""
    met = {}
    for key, population in profile.populations.items():
        if key.split("|")[0] != drafter or (population.reached.get(1) or [0.0])[0] < least:
            continue
        row = Acceptance(population=population)
        met[key] = {"first_draft": population.rate(1),
                    "picks": {name: speedup(option, row, profile) for name, option in options.items()}}
    return met


def _as_seen(rate: float, option: Option) -> Acceptance:
    """A row's acceptance as if so many drafts had been seen at each depth and breadth of ``option`` that the prior
    no longer counts: a chain's first draft passing at ``rate``, each later depth ``LATER_DEPTHS`` as often as the
    one before, wider drafts catching the prior's share of a chain's misses (``cost.widened``)."""
    acceptance, seen = Acceptance(), 1e6
    for breadth in option.breadths():
        acceptance.reached[breadth] = [seen] * option.cap
        acceptance.passed[breadth] = [seen * widened(rate, breadth) * LATER_DEPTHS ** j for j in range(option.cap)]
    return acceptance


def progress_line(text: str) -> None:
    print(f"fuzzyspec: measuring {text} ...", file=sys.stderr, flush=True)
