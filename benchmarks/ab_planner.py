"""The cost planner's estimates, A/B: the default job under variants of the planner's constants, against AR and a
fixed 1-token chain, every variant decoding every prompt in turn (interleaved, each running after each other about
equally often: ``turns.py``), each with its own copy of the cost profile (measured as it runs, from the same start).

A variant is ``ar``, ``chainN`` (every step an N-token EAGLE chain), ``trees`` (every step a whole EAGLE-2 tree of
the default size, unplanned), or ``+``-joined changes to the planner as
shipped: ``q8rows`` (its drafter's LM head rows at 8 bits, as before they were rounded to 4 bits), ``q4rows`` (its
drafter's LM head rows at 4 bits alone, as before their highest logits were worked out again from the 8-bit rows,
``vocab.RoundedRows``, 2026-11-27), ``hfhead`` (its
EAGLE head called through transformers' decoder layer, eager, as before ``drafters.head_step``), ``q4head`` (its
EAGLE head's layers at 4 bits, Q4_1, rounded from their 8 bits), ``planN`` (the draft sizes planned every N steps;
``plan1``: every step, as before ``engine.PLAN_EVERY``), ``chains`` (chains only, no trees), ``fixedprior`` (every
row's acceptance prior the fixed ``PRIOR_ACCEPTANCE``, as before the drafter's learnt prior,
``Profile.population``), ``wWmM`` (a row's prior worth W steps, its counts fading by 0.M a step), ``pP`` (the prior
acceptance 0.P), ``kK`` (each further child per node catching 0.K of the misses before it), ``meanfold`` (costs as a
running mean, as before 2026-11-26), ``pywrapper`` (the target's and head's compiled steps with inductor's Python
wrapper and size checks, as before ``step.CPU_INDUCTOR``) and ``unfused`` (eager float32 layers' norms and rotary
embeddings through PyTorch's operations, as before their calls in ``layer_kernel.cpp``), ``nocopy`` (the EAGLE head
alone, never copying from the text, as before ``drafters.lookup.CopyFirst``), ``gammacopy`` (every copy as long as
--gamma allows, as before ``cost.copy_length``), ``nopace`` (each size's cost its own running median, no machine
pace, as before ``Profile.pace``), ``oneband`` (one row's passes priced alike after any context, as before
``cost.context_band``), ``nowindow`` (the EAGLE head reading the whole text, however long, as before
``drafters.eagle.trained_length``), ``dynamohead`` (the EAGLE head's compiled calls through dynamo at every
capacity, as before its direct calls, 2026-11-27), ``indexkeep`` (a tree's kept path moved in the
target's cache by two indexing operations a layer's tensor, as before ``layer_kernel.cpp``'s ``keep_columns``,
2026-11-27), ``f32cache`` (the target's keys and values cached in float32, as before a 4-bit target's float16 cache,
2026-11-27), ``perop`` (a 4-bit target's eager layers op by op, as before their one call each,
``step.whole_layer``, 2026-11-29), ``head2``,
``head3`` (the default job drafting with the EAGLE head in ``--head DIR;DIR3``, loaded as the shipped one is, each a
job of its own: two heads compared alike), ``lookup`` (prompt lookup alone, ``--draft lookup``: what the head adds);
``held`` (every row held back from drafting by the plan; copies still proposed),
``doubtN`` (a row stops drafting only where drafting loses with its acceptances raised by N/10 standard errors,
``cost.DOUBT``; ``doubt0``: as before 2026-11-27, late evening, when it stopped wherever its estimate said so),
``poolar`` (a row drafts nothing only where its drafter's acceptance over all rows would draft nothing too:
``pooled_ar``), ``tuned`` (the job as shipped, from the profile ``fuzzyspec tune`` would leave: ``tuning.measure`` after preparing,
where every other variant starts from an empty one);
``norefresh`` (no plan drafts a 1-token chain to re-measure its pass, as before ``engine.REFRESH``, 2026-11-28);
``cap256`` (a compiled step's caches starting at 256 positions, as before 2026-11-28, afternoon: every capacity the
prompts reach compiled ahead for it too); ``dynamo`` (the target's compiled steps through dynamo with frozen weights,
a graph per capacity, as before ``core.kept``, 2026-11-28, evening);
``pywrapper``, ``unfused``, ``f32cache``, ``perop``, ``cap256`` and ``dynamo`` also join ``ar`` (``ar+pywrapper``,
``ar+unfused``, ``ar+f32cache``, ``ar+perop``, ``ar+cap256``, ``ar+dynamo``).
The planner before 2026-11-26 is ``meanfold+w2m95+p6+k15``; ``default`` is the planner as shipped.

With ``--context N`` each everyday prompt is asked as the last turn of a long chat: after whole exchanges of held-out
ShareGPT conversations (ones no drafter trained on, ``data.is_held_out``) worth about N tokens, a different chat for
each prompt: how the planner does where a step's attention reads a long cache. With ``--mixed`` too, only every other
prompt is (its category marked "+chat"): long and short contexts in turn, as a server meets them.

Prints tokens/s and its ratio to AR, tokens per target pass, the share of steps that drafted nothing, the ratio per
prompt category, and each variant's profile at the end; and the CPU's instruction sets.

With ``--source sharegpt`` the prompts are held-out ShareGPT conversations' first messages (as
``bench_drafters.py``'s set: at most 2,000 characters), the training source's own kind of text, beside the everyday
set that no drafter saw the like of.

Usage: python benchmarks/ab_planner.py [--mode compiled] [--form int4] [--prompts 24] [--source everyday|sharegpt]
           [--context 0 [--mixed]] [--variants ar,meanfold+w2m95+p6+k15,default,chain1] [--head DIR[;DIR3]]
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_drafters import load_prompts  # noqa: E402 (this folder's modules)
from bench_step import everyday  # noqa: E402
from turns import balanced_turns  # noqa: E402

from fuzzyspec import tuning  # noqa: E402
from fuzzyspec.api import ModelPair  # noqa: E402
from fuzzyspec.core import cost, engine, int4, kvcache, step as step_module, vocab as vocab_module  # noqa: E402
from fuzzyspec.core.cost import Profile  # noqa: E402
from fuzzyspec.core.step import TargetStep  # noqa: E402
from fuzzyspec.data import is_held_out, read_sharegpt  # noqa: E402
from fuzzyspec.drafters.eagle import EagleDrafter, head_logits  # noqa: E402
from fuzzyspec.drafters.lookup import CopyFirst  # noqa: E402
from fuzzyspec.drafters import head_step as head_step_module  # noqa: E402
from fuzzyspec.drafters.head_step import HeadStep, ModuleStep, head_step  # noqa: E402
from fuzzyspec.drafters.registry import DrafterSource, load_drafter  # noqa: E402
from fuzzyspec.loading import cpu_isa  # noqa: E402

SHIPPED = {name: getattr(cost, name) for name in ("PRIOR_WEIGHT", "MEMORY", "DOUBT", "PRIOR_ACCEPTANCE", "PRIOR_WIDER",
                                                  "_fold", "PACE_SHARE", "PACE_CLAMP", "context_band")}
POPULATION = Profile.population
SHIPPED_PLAN_EVERY = engine.PLAN_EVERY
SHIPPED_REFRESH = engine.REFRESH
SHIPPED_FUSED = step_module.fused_eager
SHIPPED_COPY_LENGTH = engine.copy_length
SHIPPED_PLAN = engine.plan


def pooled_ar(options, acceptances, profile, *args, **kwargs):
    """``poolar``: the plan as shipped, but a row drafts nothing only where its drafter's acceptance over every row
    (the row's prior, ``Profile.population``) would draft nothing too; where the row alone would stop, it drafts what
    that acceptance picks. (A lead of 2026-11-27, night: over all 64 everyday prompts the shipped planner sent 19-34%
    of steps to AR and ran level with a fixed 1-token chain natively, 3% behind it on the AVX2 class, emulated.)"""
    picks = SHIPPED_PLAN(options, acceptances, profile, *args, **kwargs)
    pooled = SHIPPED_PLAN(options, [cost.Acceptance(population=a.population) for a in acceptances], profile, *args,
                          **kwargs)
    return [pick if pick != (0, 1) else fallback for pick, fallback in zip(picks, pooled)]
SHIPPED_KERNELS = kvcache.kernels
DIRECT: dict = {}  # each EAGLE head step's kept graphs (``core.kept``; ``dynamohead`` sets them aside)
HEADS: list[torch.nn.Module] = []  # the EAGLE heads the variants draft with (``nowindow`` changes their window)
# parts that build a job of their own
OWN_JOB = {"q8rows", "q4rows", "hfhead", "q4head", "pywrapper", "nocopy", "f32cache", "perop", "head2", "head3",
           "cap256", "dynamo", "lookup"}
COMMON = {"max_new_tokens": 128, "eos_token_ids": ()}


class FirstCapacity256(TargetStep):
    """A target step whose caches start at 256 positions, compiled or not (``cap256``: as before 2026-11-28)."""

    @property
    def min_capacity(self) -> int:
        return 256


class ThroughDynamo(TargetStep):
    """A target step whose compiled graphs run through dynamo, with frozen weights, one per cache capacity
    (``dynamo``: as before ``core.kept``, 2026-11-28, evening)."""

    def _compiled_forward(self) -> step_module.Compiled:
        if self._compiled is None:
            self._compiled = step_module.Compiled(self.forward, self.model.get_input_embeddings().weight.device)
        return self._compiled


def mean_fold(measured: dict[int, float], x: int, ms: float) -> None:
    """Costs as the planner kept them before 2026-11-26: a fifth of the way to each measurement, at most half."""
    old = measured.get(x)
    measured[x] = ms if old is None else old + 0.2 * max(-old / 2, min(old / 2, ms - old))


def logits_module(head: torch.nn.Module, target: torch.nn.Module) -> torch.nn.Module:
    """The module ``head_logits`` reads an EAGLE head's draft vocabulary's rows through."""
    return vocab_module.reduced_lm_head(target.get_output_embeddings(), head.vocab)


def four_bit(head: torch.nn.Module) -> torch.nn.Module:
    """A copy of an EAGLE head whose 8-bit layers (Q8_0, as a 4-bit target's drafter reads them) are rounded to
    Q4_1, as llama.cpp rounds a float weight."""
    head = copy.deepcopy(head)
    for parent in list(head.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, int4.Int8Linear):
                setattr(parent, name, int4.Int4Linear.rounded(child.weight.detach()))
    return head


def apply(variant: str) -> dict:
    """Set the planner's constants for ``variant``; the decoding options it runs with."""
    for name, value in SHIPPED.items():
        setattr(cost, name, value)
    Profile.population = POPULATION
    engine.PLAN_EVERY = SHIPPED_PLAN_EVERY
    engine.REFRESH = SHIPPED_REFRESH
    step_module.fused_eager = SHIPPED_FUSED
    engine.copy_length = SHIPPED_COPY_LENGTH
    engine.plan = SHIPPED_PLAN
    kvcache.kernels = SHIPPED_KERNELS
    engine.attention_mask = head_step_module.attention_mask = kvcache.attention_mask
    for step in list(head_step_module._STEPS.values()):
        if isinstance(step, HeadStep):
            step._kept = DIRECT.setdefault(step, step._kept)
    for head in HEADS:
        head.window = head.shipped_window
    options = {}
    for part in variant.split("+"):
        if part == "ar":
            options["method"] = "ar"
            continue
        if part.startswith("chain") and part[5:].isdigit():  # every step an N-token chain
            options |= {"tree": False, "gamma": int(part[5:]), "gamma_schedule": "constant", "method": "sd"}
        elif part == "trees":  # every step a whole tree of the default size
            options |= {"tree": True, "gamma_schedule": "constant", "method": "sd"}
        elif part in OWN_JOB or part == "tuned":
            continue  # (its own job, or its own starting profile: see main)
        elif part == "fixedprior":  # every row's prior PRIOR_ACCEPTANCE, as before 2026-11-26's learnt prior
            Profile.population = lambda self, key: None
        elif part.startswith("plan") and part[4:].isdigit():  # plan every N steps (1: every step, as before
            engine.PLAN_EVERY = int(part[4:])  # 2026-11-26's engine.PLAN_EVERY)
        elif part == "unfused":
            step_module.fused_eager = lambda x: False
        elif part == "gammacopy":  # every copy at its cap, as before cost.copy_length (2026-11-26, night)
            engine.copy_length = lambda acceptance, profile, cap, *shape: cap
        elif part == "nopace":  # each size's cost its own running median, no pace, as before 2026-11-26 (late)
            cost.PACE_SHARE, cost.PACE_CLAMP = 0.0, cost.STRIDE
        elif part == "dynamohead":  # the head's calls through dynamo, as before its direct calls (2026-11-27)
            for step in DIRECT:
                step._kept = None
        elif part == "indexkeep":  # kept paths moved by indexing, as before keep_columns (2026-11-27); masks as now
            kvcache.kernels = types.SimpleNamespace(loaded=lambda: False)
            engine.attention_mask = head_step_module.attention_mask = torch.ops.fuzzyspec_layer.attention_mask
        elif part == "norefresh":  # no plan re-measures a 1-token chain's pass, as before engine.REFRESH (2026-11-28)
            engine.REFRESH = 10**9
        elif part == "chains":
            options["tree"] = False
        elif part == "held":  # every row held back from drafting (what a held-back step costs beside AR's; a copying
            engine.plan = lambda options, *_, **__: [(0, 1)] * len(options)  # drafter still copies)
        elif part == "poolar":  # a row stops drafting only where its drafter's rows overall would (``pooled_ar``)
            engine.plan = pooled_ar
        elif part == "nowindow":  # the head reads the whole text, as before its window (2026-11-27)
            for head in HEADS:
                head.window = None
        elif part == "oneband":  # one row's passes priced alike after any context, as before 2026-11-27 (evening)
            cost.context_band = lambda context: 0
        elif part == "meanfold":
            cost._fold = mean_fold
        elif part.startswith("doubt") and part[5:].isdigit():  # a row stops drafting only where drafting loses with
            cost.DOUBT = int(part[5:]) / 10  # its acceptances raised by N/10 standard errors (doubt0: as before
            # 2026-11-27, late evening, when it stopped wherever its estimate said drafting lost)
        elif part.startswith("w") and "m" in part:
            cost.PRIOR_WEIGHT = float(part[1: part.index("m")])
            cost.MEMORY = float("0." + part[part.index("m") + 1:])
        elif part.startswith("p"):
            cost.PRIOR_ACCEPTANCE = float("0." + part[1:])
        elif part.startswith("k"):
            cost.PRIOR_WIDER = float("0." + part[1:])
        elif part != "default":
            raise SystemExit(f"unknown variant part {part!r}")
    return options


def chats(prompts: list[tuple[str, str]], tokenizer, context: int, mixed: bool = False
          ) -> list[tuple[str, str | list[dict]]]:
    """Each prompt (every other one where ``mixed``, its category marked "+chat") as the last turn of a chat whose
    earlier turns are whole exchanges (a user message and its answer) of held-out ShareGPT conversations, taken in
    file order, worth about ``context`` tokens; the prompts as they are where ``context`` is 0."""
    if context <= 0:
        return prompts
    exchanges = ((first, second) for conversation in read_sharegpt() if is_held_out(conversation.id)
                 for first, second in zip(conversation.messages, conversation.messages[1:])
                 if first["role"] == "user" and second["role"] == "assistant")
    made: list[tuple[str, str | list[dict]]] = []
    for index, (category, prompt) in enumerate(prompts):
        if mixed and index % 2:
            made.append((category, prompt))
            continue
        messages: list[dict] = []
        size = 0
        while size < context:
            first, second = next(exchanges)
            messages += [first, second]
            size += sum(len(tokenizer(message["content"])["input_ids"]) for message in (first, second))
        made.append((category + ("+chat" if mixed else ""), messages + [{"role": "user", "content": prompt}]))
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("eager", "compiled"), default="compiled")
    parser.add_argument("--form", default="int4", help="weights: int4, fp32 or bf16")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default="ar,meanfold+w2m95+p6+k15,default,chain1")
    parser.add_argument("--source", choices=("everyday", "sharegpt"), default="everyday",
                        help="the prompts: everyday (by category), or held-out ShareGPT conversations' first ones")
    parser.add_argument("--context", type=int, default=0, help="tokens of earlier chat turns before each prompt")
    parser.add_argument("--mixed", action="store_true", help="with --context: only every other prompt in a chat")
    parser.add_argument("--head", default=None, help="DIR[;DIR3]: variant parts head2 (head3): the default job "
                        "drafting with the EAGLE head in DIR (DIR3)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    if "ar" not in variants:
        raise SystemExit("--variants must include ar (the ratios are to it)")
    pair = ModelPair.load(draft=None, weights=args.form)
    step = TargetStep(pair.target, compile=args.mode == "compiled")
    source = pair.with_drafter("default").draft
    job = ModelPair(pair.target, pair.tokenizer, source, step, None)
    jobs = {variant: job for variant in variants}
    head, embed = source.module, pair.target.get_input_embeddings()
    head.shipped_window = head.window
    HEADS.append(head)
    lm_head = pair.target.get_output_embeddings()
    python_wrapper = float_cache = per_op = small_first = through_dynamo = None
    for variant in variants:
        parts = variant.split("+")
        if not OWN_JOB & set(parts):
            continue
        variant_step, own_head = step, None
        if "pywrapper" in parts:  # compiled steps of its own, target's and head's, built as before CPU_INDUCTOR
            if not step.compile:
                raise SystemExit("pywrapper compares compiled steps: --mode compiled")
            if python_wrapper is None:  # (one pair of them for every such variant)
                step_module.CPU_INDUCTOR, shipped = None, step_module.CPU_INDUCTOR
                python_wrapper = TargetStep(pair.target, compile=True), HeadStep(head, embed)
                python_wrapper[0]._compiled_forward()
                python_wrapper[1].prepare(256)  # (a graph's options are fixed when it is first compiled)
                step_module.CPU_INDUCTOR = shipped
            variant_step, own_head = python_wrapper
        if "f32cache" in parts:  # a step of its own (its own graphs) over a float32 cache
            if float_cache is None:
                float_cache = TargetStep(pair.target, compile=step.compile)
                float_cache.cache_dtype = torch.float32
            variant_step = float_cache
        if "perop" in parts:  # a step of its own whose eager layers run op by op, as before whole_layer
            if per_op is None:
                per_op = TargetStep(pair.target, compile=step.compile)
                per_op.forward.whole = None
            variant_step = per_op
        if "cap256" in parts:  # a step of its own (its own graphs) whose caches start at 256 positions
            if small_first is None:
                small_first = FirstCapacity256(pair.target, compile=step.compile)
            variant_step = small_first
        if "dynamo" in parts:  # a step of its own whose graphs run through dynamo, as before core.kept
            if through_dynamo is None:
                through_dynamo = ThroughDynamo(pair.target, compile=step.compile)
            variant_step = through_dynamo
        if "lookup" in parts:  # prompt lookup's drafts alone, planned and judged as the default job's are
            jobs[variant] = ModelPair(pair.target, pair.tokenizer, load_drafter("lookup", pair.target, pair.tokenizer),
                                      variant_step, None)
            continue
        variant_head = four_bit(head) if "q4head" in parts else head
        chosen = [n for n, part in enumerate(("head2", "head3")) if part in parts]
        if chosen:  # another head folder, loaded in the target's form as the shipped one is
            folders = (args.head or "").split(";")
            if len(folders) <= chosen[0] or not folders[chosen[0]]:
                raise SystemExit("head2 needs --head DIR, head3 --head DIR;DIR3")
            variant_head = pair.with_drafter(f"eagle:{folders[chosen[0]]}").draft.module
            variant_head.shipped_window = variant_head.window
        if variant_head is not head:
            HEADS.append(variant_head)
        logits = head_logits(variant_head, pair.target)
        if "q8rows" in parts:
            # the default job, its drafter reading its LM head rows at 8 bits, as before 2026-11-26 (4 bits since)
            rows = lm_head.rows(head.vocab.target_ids) if isinstance(lm_head, int4.Int8Linear) else None
            if rows is None:
                raise SystemExit("q8rows needs the int4 form (an 8-bit LM head)")
            logits = lambda out, rows=rows: rows(out).float()  # noqa: E731
        if "q4rows" in parts:  # 4-bit rows alone, as before 2026-11-27 (their top logits worked out again since)
            rounded = getattr(logits_module(variant_head, pair.target), "rows", None)
            if rounded is None:
                raise SystemExit("q4rows needs the int4 form (an 8-bit LM head)")
            logits = lambda out, rows=rounded: rows(out).float()  # noqa: E731

        def make(vocab_size: int, logits=logits, parts=parts, variant_head=variant_head, own_head=own_head
                 ) -> EagleDrafter | CopyFirst:
            drafter = EagleDrafter(variant_head, pair.target, vocab_size, logits)
            if "hfhead" in parts:  # the head through transformers' layer, as before 2026-11-26
                drafter.step = ModuleStep(variant_head, embed)
            if own_head is not None:
                drafter.step = own_head
            return drafter if "nocopy" in parts else CopyFirst(drafter)

        jobs[variant] = ModelPair(pair.target, pair.tokenizer,
                                  DrafterSource(source.name, variant_head, make, drafts_trees=True,
                                                prepare=head_step(variant_head, embed).prepare
                                                if {"q4head", "head2", "head3"} & set(parts) else None),
                                  variant_step, None)
    asked = everyday(args.prompts) if args.source == "everyday" else \
        [("sharegpt", prompt) for prompt in load_prompts("sharegpt", args.prompts)]
    prompts = chats(asked, pair.tokenizer, args.context, args.mixed)
    encoded = [job.encode(prompt) for _, prompt in prompts]  # (a long chat's template takes a while: once)
    # every cache capacity the prompts' steps run at (the engine's: its first, doubled to hold the prompt, then the
    # answer)
    lengths = {ids.shape[1] + extra for ids in encoded for extra in (1, 1 + COMMON["max_new_tokens"])}

    def capacities(first: int) -> tuple[int, ...]:
        return tuple(sorted({first} | {max(first, 1 << (length - 1).bit_length()) for length in lengths}))

    if step.compile:
        tuning.prepare(job, job.config(**COMMON), capacities(step.min_capacity))
        for variant in variants:  # a variant's own head or step compiles its own graphs, ahead as the shipped ones are
            if jobs[variant].step is not step:
                tuning.prepare(jobs[variant], job.config(**COMMON), capacities(jobs[variant].step.min_capacity))
            elif jobs[variant].draft.prepare is not None and jobs[variant].draft is not source:
                jobs[variant].draft.prepare(256)
    start = step.profile.to_dict()
    profiles = {variant: Profile.from_dict(start) for variant in variants}
    if any("tuned" in variant.split("+") for variant in variants):  # the profile `fuzzyspec tune` would leave
        kept, step.profile = step.profile, Profile.from_dict(start)
        tuning.measure(job, job.config(**COMMON), (1, 2, 4, 6, 8, 17) if step.compile else tuning.WIDTHS,
                       progress=tuning.progress_line)
        tuned, step.profile = step.profile.to_dict(), kept
        for variant in variants:
            if "tuned" in variant.split("+"):
                profiles[variant] = Profile.from_dict(tuned)
    for variant in variants:  # warm: each variant's first steps measure its profile's new sizes
        options, jobs[variant].step.profile = apply(variant), profiles[variant]
        jobs[variant].generate(encoded[0], **(COMMON | options))
    totals = {v: {"seconds": 0.0, "decoding": 0.0, "tokens": 0, "passes": 0, "drafted": 0, "by_category": {}}
              for v in variants}
    turns = balanced_turns(variants, len(prompts))  # (each variant behind each other alike: turns.py says why)
    for index, ((category, _), ids, order) in enumerate(zip(prompts, encoded, turns)):
        for variant in order:
            options, jobs[variant].step.profile = apply(variant), profiles[variant]
            clock = time.perf_counter()
            stats = jobs[variant].generate(ids, **(COMMON | options)).stats
            seconds = time.perf_counter() - clock
            total = totals[variant]
            total["seconds"] += seconds
            total["decoding"] += stats.wall_s  # (from the row's first step: its prompt's prefill left out)
            total["tokens"] += stats.new_tokens
            total["passes"] += stats.target_forwards
            total["drafted"] += stats.reached_at[0] if stats.reached_at else 0
            made = total["by_category"].setdefault(category, [0, 0.0])
            made[0] += stats.new_tokens
            made[1] += stats.wall_s if args.context else seconds  # (with long prompts, the decoding alone)
        print(f"fuzzyspec: prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    apply("default")
    contexts = [ids.shape[1] for ids in encoded]
    print(f"CPU: {cpu_isa()}; {args.threads} threads; torch {torch.__version__}; {args.form} {args.mode}; "
          f"{len(prompts)} {args.source} prompts x {COMMON['max_new_tokens']} tokens, greedy; prompts of "
          f"{min(contexts)}-{max(contexts)} tokens (median {sorted(contexts)[len(contexts) // 2]})")
    ar = totals["ar"]
    if args.context:
        print("categories: tok/s of the decoding alone (each answer's prefill left out)")

    def speed(tokens: float, seconds: float) -> float:
        return tokens / seconds if seconds else 0.0

    for variant in variants:
        total = totals[variant]
        rate = speed(total["tokens"], total["seconds"])
        categories = {c: speed(*made) / speed(*ar["by_category"][c]) for c, made in total["by_category"].items()}
        decoding = ""
        if args.context:  # (a long prompt's prefill is much of each answer's time: the decoding apart)
            alone = speed(total["tokens"], total["decoding"])
            decoding = f"(decoding alone {alone:.1f} tok/s, x AR {alone / speed(ar['tokens'], ar['decoding']):.3f})  "
        print(f"{variant:24s} {rate:7.1f} tok/s  x AR {rate / speed(ar['tokens'], ar['seconds']):.3f}  {decoding}"
              f"tok/pass {total['tokens'] / total['passes']:.2f}  steps drafting nothing "
              f"{1 - total['drafted'] / total['passes']:.2f}  categories {min(categories.values()):.3f}-"
              f"{max(categories.values()):.3f}  " + " ".join(f"{c} {r:.3f}" for c, r in categories.items()))
    for variant in variants:
        print(f"profile {variant}: {json.dumps(profiles[variant].to_dict())}")


if __name__ == "__main__":
    main()
