"""Decoding speed on a GPU, in one process: transformers' generate beside our engine, eager and compiled.

Two model sets: (a) a random Llama of about 1B parameters in bfloat16 with a random 2-layer draft of the same
vocabulary and a random EAGLE head (random weights accept almost nothing: the rows measure the machinery,
and AR's share of the memory-bandwidth limit); (b) the embedded SmolLM2-135M-Instruct in bfloat16 with its
shipped drafters (real acceptance). Prompts: the everyday set (fuzzyspec/prompts/everyday.jsonl, never trained
on), greedy, --tokens new tokens each, EOS never stops a run; every configuration interleaved per prompt, after
a warm-up answer of the same length that compiles the shapes a row uses (compilations left for the timed
answers are counted and printed).

Rows: HF generate (eager, dynamic cache), HF generate with its static cache (which transformers compiles itself
on a GPU, with CUDA graphs); our AR eager, compiled,
and compiled with CUDA graphs (``TargetStep(graphs=...)``, captured by ``core.graphs``), the last also not run one
step ahead (without ``Engine.lookahead``), with the q, k, v (gate, up) products apart, as before they were fused,
and with inductor's CUDA graphs ("reduce-overhead"), as steps were captured before 2026-11-27; chain sd with the
draft model; EAGLE-2 trees sd at a constant size (also on inductor's graphs, the head's steps included); the default
job (cost-planned EAGLE-2 trees, lossless); chain fsd and fsd-hybrid (js, T = 0.3).
Drafting rows run on the CUDA-graph step. For each: tokens/s, ms per target pass, tokens per pass; for AR the
fraction of the memory-bandwidth limit (weight bytes read per step over the copy bandwidth measured on this
device: a step cannot be faster than reading every weight once); and, for the drafting rows, the acceptance
step's share of decoding time, timed with a device sync on each side of it in a separate answer.

A row that fails prints its error and is dropped; the others go on. ``--profile ROWS`` shows where the host spends
one more answer of each row (cProfile); ``--timeline ROWS`` runs one more under torch's profiler: the share of the
answer the GPU was busy, the host's dearest operations and the longest kernels.

Usage: python benchmarks/bench_gpu.py [--sets random,embedded] [--prompts 4] [--tokens 128] [--json PATH]
                                      [--rows 'LABEL;LABEL'] [--profile 'LABEL;...'] [--timeline 'LABEL;...']
       python benchmarks/bench_gpu.py --device cpu --tiny --tokens 8      (a smoke test of the script itself)
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench_step import everyday
from turns import balanced_turns
from fuzzyspec import tuning
from fuzzyspec.api import ModelPair
from fuzzyspec.core import engine as engine_module
from fuzzyspec.core.step import Compiled, TargetStep
from fuzzyspec.drafters.draftlm import DraftLM
from fuzzyspec.drafters.eagle import EagleDrafter, head_logits
from fuzzyspec.drafters.eagle_head import EagleHead
from fuzzyspec.drafters.head_step import HeadStep, head_step
from fuzzyspec.drafters.model import ModelDrafter
from fuzzyspec.drafters.registry import DrafterSource
from fuzzyspec.loading import gguf_tokenizer_folder

# label -> (step: "hf", "hf-static", "eager", "compiled", "graphs", "apart", "inductor"; drafter; decoding options);
# "apart": graphs with q, k, v (gate, up) as separate products, as before ``step.fuse_float_projections``;
# "inductor": inductor's own CUDA graphs (``InductorGraphs``), for the target's steps and an EAGLE head's

ROWS = {
    "HF generate, eager": ("hf", None, None),
    "HF generate, static cache": ("hf-static", None, None),
    "our AR, eager": ("eager", None, {"method": "ar"}),
    "our AR, compiled": ("compiled", None, {"method": "ar"}),
    "our AR, compiled + CUDA graphs": ("graphs", None, {"method": "ar"}),
    "our AR, graphs, not run ahead": ("graphs", None, {"method": "ar", "lookahead": False}),
    "our AR, graphs, projections apart": ("apart", None, {"method": "ar"}),
    "our AR, inductor's graphs": ("inductor", None, {"method": "ar"}),
    "chain sd, draft model": ("graphs", "draft", {"method": "sd", "gamma_schedule": "constant"}),
    "EAGLE-2 trees sd, constant": ("graphs", "eagle", {"method": "sd", "tree": True, "gamma_schedule": "constant"}),
    "EAGLE-2 trees sd, constant, inductor's graphs": ("inductor", "eagle", {"method": "sd", "tree": True,
                                                                          "gamma_schedule": "constant"}),
    "default job (planned EAGLE-2 trees sd)": ("graphs", "eagle", {"method": "sd", "tree": True}),
    "default job, plans every 4 (as before)": ("graphs", "eagle", {"method": "sd", "tree": True,
                                                                     "held_plan_every": 4}),
    "chain fsd js 0.3": ("graphs", "draft", {"method": "fsd", "threshold": 0.3, "gamma_schedule": "constant"}),
    "chain fsd-hybrid js 0.3": ("graphs", "draft", {"method": "fsd-hybrid", "threshold": 0.3,
                                                    "gamma_schedule": "constant"}),
}


class InductorGraphs(Compiled):
    """Compiled steps as they were captured before 2026-11-27: inductor's "reduce-overhead" mode (its CUDA graph
    trees, behind dynamo's cache lookup on every call), kept to compare with ``core.graphs``."""

    def __init__(self, function, device: torch.device) -> None:
        super().__init__(function, device)
        self.function = torch.compile(function, dynamic=False, mode="reduce-overhead")

    def __call__(self, key: tuple, *arguments):
        torch.compiler.cudagraph_mark_step_begin()  # what the last replay returned is no longer read
        return super().__call__(key, *arguments)


class InductorHead:
    """While entered, an EAGLE head's step (shared by its drafters) runs on ``InductorGraphs``."""

    def __init__(self, step) -> None:
        self.step, self.graphs, self.ours = step, None, None

    def __enter__(self) -> None:
        self.ours = self.step._compiled
        if self.graphs is None:
            self.graphs = InductorGraphs(self.step.forward, self.step.device)
        self.step._compiled = self.graphs

    def __exit__(self, *exc) -> None:
        self.step._compiled = self.ours


class AheadCounter:
    """While entered, counts the engine's steps run one ahead (``Engine.lookahead``), and times the steps that were
    not (``other``, ``other_s``): a row held back from drafting that runs ahead as often as AR's but slower is paying
    host time per step, one that runs ahead less is not held back, and a few steps that draft (the planner trying
    a draft now and then) may cost many run-ahead steps' time each (2026-11-28: the default job at 0.79x AR on an
    H100, drafting next to nothing)."""

    def __init__(self) -> None:
        self.count, self.other, self.other_s = 0, 0, 0.0
        self.original = engine_module.Engine._step_ahead, engine_module.Engine.step

    def __enter__(self) -> "AheadCounter":
        step_ahead, step = self.original
        ahead = [False]

        def counted(engine: engine_module.Engine):
            self.count += 1
            ahead[0] = True
            return step_ahead(engine)

        def timed(engine: engine_module.Engine):
            ahead[0] = False
            clock = time.perf_counter()
            finished = step(engine)
            if not ahead[0]:
                self.other += 1
                self.other_s += time.perf_counter() - clock
            return finished

        engine_module.Engine._step_ahead, engine_module.Engine.step = counted, timed
        return self

    def __exit__(self, *exc) -> None:
        engine_module.Engine._step_ahead, engine_module.Engine.step = self.original


def host_profile(run: Callable[[], Any], count: int = 30) -> tuple[Any, str, list[str]]:
    """``run()`` under cProfile: its result, the report of the ``count`` functions that spent the most time of their
    own, and that report's rows (its header left out)."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        result = run()
    finally:
        profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(count)
    return result, text.getvalue(), [line for line in text.getvalue().splitlines() if line.strip()][3:]


def device_timeline(run: Callable[[], Any], passes: Callable[[Any], int], count: int = 12) -> tuple[Any, list[str]]:
    """``run()`` under torch's profiler (the host's operations, and on a GPU its kernels): its result, and lines
    saying how much of the answer's time the GPU was busy (its kernels' time, summed), the host's operations that
    took the most time of their own, and the GPU's longest kernels, each per pass (``passes(result)``). A step
    whose GPU is busy for a small share of it is the host's to speed up."""
    from torch.autograd import DeviceType

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    clock = time.perf_counter()
    with torch.profiler.profile(activities=activities) as profiler:
        result = run()
    wall_ms = 1000 * (time.perf_counter() - clock)
    per = max(1, passes(result))
    averages = profiler.key_averages()

    def device_us(event) -> float:
        return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)

    kernels = [event for event in averages if event.device_type == DeviceType.CUDA]
    busy_ms = sum(map(device_us, kernels)) / 1000
    lines = [f"wall {wall_ms / per:.2f} ms a pass under the profiler; GPU busy {busy_ms / per:.2f} ms a pass "
             f"({100 * busy_ms / wall_ms:.0f}%), {sum(event.count for event in kernels) / per:.0f} kernels a pass"]
    host = sorted((event for event in averages if event.device_type == DeviceType.CPU),
                  key=lambda event: event.self_cpu_time_total, reverse=True)[:count]
    lines += [f"host {event.self_cpu_time_total / 1000 / per:7.3f} ms a pass, {event.count / per:6.1f} calls  "
              f"{event.key[:80]}" for event in host]
    lines += [f"GPU  {device_us(event) / 1000 / per:7.3f} ms a pass, {event.count / per:6.1f} calls  {event.key[:80]}"
              for event in sorted(kernels, key=device_us, reverse=True)[:count // 2]]
    return result, lines


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write), the best of five."""
    size = 1 << 30 if device.type == "cuda" else 1 << 27
    a, b = torch.empty(size, dtype=torch.uint8, device=device), torch.empty(size, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        clock = time.perf_counter()
        b.copy_(a)
        _sync(device)
        best = min(best, time.perf_counter() - clock)
    return 2 * size / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_config(vocab_size: int, tiny: bool) -> LlamaConfig:
    """TinyLlama-1.1B's shape (tiny: 2 layers of width 64), untied, with ``vocab_size`` tokens."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2) if tiny else \
        dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4)
    return LlamaConfig(vocab_size=vocab_size, max_position_embeddings=4096, tie_word_embeddings=False, **shape)


def random_pair(device: torch.device, tiny: bool, tokenizer_folder: str | None) -> ModelPair:
    """A random ~1B Llama (tiny: a few layers of width 64), a random 2-layer draft of its vocabulary, and a random
    EAGLE head; the embedded tokenizer (its vocabulary: 49,152 tokens), or the one in ``tokenizer_folder``."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder or gguf_tokenizer_folder())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = random_config(len(tokenizer), tiny)
    torch.manual_seed(0)
    with device:  # initialised where it runs: a 1B model's random init on the host takes a while
        target = LlamaForCausalLM(config).to(dtype).eval()
        draft = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 2})).to(dtype).eval()
        head = EagleHead.for_target(target).to(device, dtype).eval()
    logits = head_logits(head, target)
    pair = ModelPair(target, tokenizer)
    pair.drafts = {
        "draft": DrafterSource("draft", draft, lambda v: ModelDrafter(draft, v), DraftLM(draft).width),
        "eagle": DrafterSource("eagle", head, lambda v: EagleDrafter(head, target, v, logits), drafts_trees=True)}
    return pair


def embedded_pair(device: torch.device) -> ModelPair:
    """The embedded target with the shipped drafters the rows use."""
    pair = ModelPair.load(draft=None, device=str(device), weights="bf16" if device.type == "cuda" else "auto")
    used = {draft for _, draft, _ in ROWS.values() if draft is not None}
    pair.drafts = {name: pair.with_drafter(name, device=str(device)).draft for name in sorted(used)}
    return pair


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decoding step reads: every parameter and buffer once (views of a fused weight counted with it;
    the embedding's rows aside: one row)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    embedding = model.get_input_embeddings().weight
    tied = embedding.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    total = sum(storages.values())
    return total if tied else total - embedding.numel() * embedding.element_size()


class SyncedJudge:
    """The engine's ``judge``, timed with the device synchronised before and after: its whole cost, device
    work included (the engine's own timing leaves the device's part of it to the step's one wait)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self.original = device, 0.0, engine_module.judge

    def __call__(self, *args, **kwargs):
        _sync(self.device)
        clock = time.perf_counter()
        pending = self.original(*args, **kwargs)
        _sync(self.device)
        self.seconds += time.perf_counter() - clock
        return pending

    def __enter__(self) -> "SyncedJudge":
        engine_module.judge = self
        return self

    def __exit__(self, *exc) -> None:
        engine_module.judge = self.original


def run_set(name: str, pair: ModelPair, device: torch.device, prompts: list[str], tokens: int,
            bandwidth: float, profile: list[str] = (), timeline: list[str] = ()) -> list[dict]:
    steps = {"eager": TargetStep(pair.target), "compiled": TargetStep(pair.target, compile=True, graphs=False),
             "graphs": TargetStep(pair.target, compile=True), "apart": TargetStep(pair.target, compile=True),
             "inductor": TargetStep(pair.target, compile=True)}
    if steps["inductor"].graphs:
        steps["inductor"]._compiled = InductorGraphs(steps["inductor"].forward, device)
    else:  # (no GPU: the row is the compiled one again)
        del steps["inductor"]
    eagle = pair.drafts.get("eagle")
    head = head_step(eagle.module, pair.target.get_input_embeddings()) if eagle is not None else None
    inductor_head = InductorHead(head) if isinstance(head, HeadStep) and head.graphs else contextlib.nullcontext()
    forward = steps["apart"].forward
    if hasattr(forward, "qkv"):
        forward.qkv, forward.gate_up = [None] * len(forward.qkv), [None] * len(forward.gate_up)
    compiles = {kind: 0 for kind in steps}
    for kind, step in steps.items():
        step.on_compile = lambda rows, width, kind=kind: compiles.__setitem__(kind, compiles[kind] + 1)
    curve = {}
    print(f"  [{name}] target passes (compiling) ...", flush=True)
    for kind in ("eager", "graphs"):  # one pass of k tokens after 128 cached ones (each width a graph of its own)
        try:
            curve[kind] = tuning.measure_target(steps[kind], (1, 6, 17), compiled=kind != "eager")[0]
        except Exception as error:  # the drafting rows then run on the compiled step without graphs
            print(f"  [{name}] target pass, {kind} FAILED: {type(error).__name__}: {error}"[:400], flush=True)
            traceback.print_exc()
            steps[kind] = steps["compiled"]
            continue
        print(f"  [{name}] target pass, {kind}: " + ", ".join(f"k={k} {ms:.2f} ms" for k, ms in curve[kind].items())
              + f" (k=6: {curve[kind][6] / curve[kind][1]:.2f}x k=1)", flush=True)
    pairs = {label: ModelPair(pair.target, pair.tokenizer, pair.drafts[draft] if draft else None, steps[kind])
             for label, (kind, draft, _) in ROWS.items() if kind in steps}
    results = {label: {"seconds": 0.0, "tokens": 0, "passes": 0, "ahead": 0, "other": 0, "other_s": 0.0, "warm_s": 0.0}
               for label in ROWS}
    failed = {label: "needs a GPU (inductor's CUDA graphs)" for label, (kind, _, options) in ROWS.items()
              if options is not None and kind not in steps}

    def answer(label: str, ids: torch.Tensor, count: int) -> tuple[int, int]:
        kind, _, options = ROWS[label]
        if options is None:  # (with a static cache on a GPU, generate compiles the forward itself)
            kwargs = {"cache_implementation": "static"} if kind == "hf-static" else {}
            out = pair.target.generate(ids, max_new_tokens=count, min_new_tokens=count, do_sample=False, **kwargs)
            return out.shape[1] - ids.shape[1], count
        options, held_plan_every = dict(options), engine_module.HELD_PLAN_EVERY
        engine_module.LOOKAHEAD = options.pop("lookahead", None)  # (None: the engine's default)
        engine_module.HELD_PLAN_EVERY = options.pop("held_plan_every", held_plan_every)  # (as before 2026-11-28: 4)
        try:
            with inductor_head if kind == "inductor" else contextlib.nullcontext():
                result = pairs[label].generate(ids, max_new_tokens=count, eos_token_ids=(), **options)
        finally:
            engine_module.LOOKAHEAD, engine_module.HELD_PLAN_EVERY = None, held_plan_every
        return result.stats.new_tokens, result.stats.target_forwards

    def timed(label: str, ids: torch.Tensor) -> tuple[float, int, int] | None:
        try:
            _sync(device)
            clock = time.perf_counter()
            made, passes = answer(label, ids, tokens)
            _sync(device)
            return time.perf_counter() - clock, made, passes
        except Exception as error:  # a failing row is reported and dropped; the others go on
            failed[label] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            print(f"  [{name}] {label} FAILED: {failed[label]}", flush=True)
            traceback.print_exc()
            return None

    encoded = [pair.encode(prompt) for prompt in prompts]
    print(f"  [{name}] warming up (compiling) ...", flush=True)
    for label in (label for label in ROWS if label not in failed):
        took = timed(label, encoded[0])
        if took is not None:
            results[label]["warm_s"] = took[0]
            print(f"  [{name}] {label}: warm-up answer {took[0]:.1f} s", flush=True)
    warm_compiles = dict(compiles)
    labels = [label for label in ROWS if label not in failed]
    for index, (ids, order) in enumerate(zip(encoded, balanced_turns(labels, len(encoded)))):
        for label in order:
            if label in failed:
                continue
            with AheadCounter() as ahead:
                took = timed(label, ids)
            if took is not None:
                total = results[label]
                total["seconds"] += took[0]
                total["tokens"] += took[1]
                total["passes"] += took[2]
                total["ahead"] += ahead.count
                total["other"] += ahead.other
                total["other_s"] += ahead.other_s
        print(f"  [{name}] prompt {index + 1}/{len(encoded)} done", flush=True)
    # the acceptance step, timed with syncs on each side of it, in one more answer per drafting row
    accept_share = {}
    for label, (kind, draft, options) in ROWS.items():
        if draft is None or label in failed:
            continue
        with SyncedJudge(device) as judge:
            took = timed(label, encoded[0])
        if took is not None:
            accept_share[label] = judge.seconds / took[0]
    for label in profile:  # where the host spends a row's answer
        if label in ROWS and label not in failed:
            took, _, lines = host_profile(lambda: timed(label, encoded[0]), 28)
            print(f"  [{name}] {label}: host by own time, one answer of {took[1] if took else '?'} tokens in "
                  f"{took[2] if took else '?'} passes (cProfile; its overhead inflates every figure):", flush=True)
            print("\n".join("     " + line[:150] for line in lines), flush=True)
    for label in timeline:  # how much of a row's answer the GPU was busy, and what the host spent it on
        if label in ROWS and label not in failed:
            took, lines = device_timeline(lambda: timed(label, encoded[0]), lambda took: took[2] if took else 0)
            print(f"  [{name}] {label}: one answer under torch's profiler (its overhead inflates the host's figures):",
                  flush=True)
            print("\n".join("     " + line for line in lines), flush=True)
    limit = bandwidth / weight_bytes(pair.target)  # steps per second if a step only read the weights
    table = []
    for label, total in results.items():
        row = {"set": name, "row": label, "error": failed.get(label), "warm_s": total["warm_s"]}
        if total["passes"] and label not in failed:
            step_ms = 1000 * total["seconds"] / total["passes"]
            row.update(tokens_per_s=total["tokens"] / total["seconds"], ms_per_pass=step_ms,
                       tokens_per_pass=total["tokens"] / total["passes"], ahead_share=total["ahead"] / total["passes"],
                       not_ahead=total["other"], not_ahead_share=total["other_s"] / total["seconds"],
                       ar_bandwidth_share=(1000 / step_ms) / limit if (ROWS[label][2] or {}).get("method") == "ar"
                       else None,
                       accept_share=accept_share.get(label))
        table.append(row)
    table.append({"set": name, "row": "target pass ms by width", "curve": curve})
    timed_compiles = {kind: compiles[kind] - warm_compiles[kind] for kind in compiles}
    print(f"  [{name}] compilations: warm-up {warm_compiles}, timed answers {timed_compiles}", flush=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="random,embedded")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny random target: checks the script, measures nothing")
    parser.add_argument("--rows", default=None, help="row labels separated by ';' (default: every row)")
    parser.add_argument("--tokenizer", default=None, help="the random set's tokenizer folder (default: the embedded one)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", default="", help="row labels separated by ';': where the host spends one more "
                                                       "answer of each (cProfile)")
    parser.add_argument("--timeline", default="", help="row labels separated by ';': one more answer of each under "
                                                        "torch's profiler (the GPU's busy share, the host's dearest "
                                                        "operations, the longest kernels)")
    args = parser.parse_args()
    if args.rows:
        for label in list(ROWS):
            if label not in args.rows.split(";"):
                del ROWS[label]
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    header = (f"fuzzyspec bench_gpu: {tuning.machine(args.device)}, transformers {transformers.__version__}; "
              f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.prompts} everyday prompts x {args.tokens} tokens, "
              f"greedy; {time.strftime('%Y-%m-%d')}")
    print(header, flush=True)
    prompts = [prompt for _, prompt in everyday(args.prompts)]
    table = []
    for name in args.sets.split(","):
        clock = time.perf_counter()
        pair = random_pair(device, args.tiny, args.tokenizer) if name == "random" else embedded_pair(device)
        held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() // p.element_size()
                for p in pair.target.parameters()}  # (views of a fused weight counted once)
        print(f"\n{name}: target {sum(held.values()) / 1e6:.0f} M parameters, "
              f"{weight_bytes(pair.target) / 1e9:.2f} GB read per step, {pair.target.dtype}; loaded in "
              f"{time.perf_counter() - clock:.0f} s", flush=True)
        rows = run_set(name, pair, device, prompts, args.tokens, bandwidth,
                       [label for label in args.profile.split(";") if label],
                       [label for label in args.timeline.split(";") if label])
        ar = {row["row"]: row.get("tokens_per_s") for row in rows}
        best_ar = max((rate for label, rate in ar.items() if label.startswith("our AR") and rate), default=None)
        for row in rows:
            if row.get("error"):
                print(f"  {row['row']:<42} failed: {row['error']}")
                continue
            if "tokens_per_s" not in row:  # (the curve, printed above)
                continue
            extra = f"  run ahead {100 * row['ahead_share']:3.0f}%"
            if row["ahead_share"] > 0 and row["not_ahead"]:  # (the steps that were not: how many, and their time)
                extra += f" ({row['not_ahead']} steps not, {100 * row['not_ahead_share']:.0f}% of the time)"
            if row["ar_bandwidth_share"] is not None:
                extra += f"  {100 * row['ar_bandwidth_share']:.0f}% of the bandwidth limit"
            if row["accept_share"] is not None:
                extra += f"  acceptance step {100 * row['accept_share']:.1f}% (synced)"
            ratio = f"{row['tokens_per_s'] / best_ar:5.2f}x" if best_ar else ""
            print(f"  {row['row']:<42} {row['tokens_per_s']:8.1f} tok/s {ratio} of our best AR  "
                  f"{row['ms_per_pass']:7.2f} ms/pass  {row['tokens_per_pass']:5.2f} tok/pass  "
                  f"warm-up {row['warm_s']:5.1f} s{extra}", flush=True)
        table += rows
        del pair
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.json:  # after each set: a later set's failure keeps the earlier numbers
            Path(args.json).write_text(json.dumps({"header": header, "rows": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
