"""Where a GPU decoding step's time goes, for a random Llama of TinyLlama-1.1B's shape in bfloat16, batch 1.

Parts, each printed as it finishes:

1. the weight products alone: every layer's projections and the LM head at one token, replayed as one CUDA graph
   (the floor a pass cannot beat with these products), and the bandwidth they reach;
2. the compiled forward's kernels (no CUDA graphs), under torch's profiler: device time per kernel kind per pass,
   how many kernels a pass runs, and their sum;
3. one compiled step with CUDA graphs as the engine calls it (``TargetStep``): latency (synchronised after every
   call) against throughput (calls queued back to back): the host's share of a call;
4. the same forward captured by hand as one ``torch.cuda.CUDAGraph`` and replayed: a replay without dynamo's
   and inductor's bookkeeping around it;
5. the engine's AR: milliseconds a token over whole answers, run one step ahead (``Engine.lookahead``) and not,
   and where the host spends a step (cProfile).

Usage: python benchmarks/profile_gpu.py [--tokens 128] [--out FOLDER]
       python benchmarks/profile_gpu.py --device cpu --tiny     (a smoke test of the script itself)
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from bench_gpu import _sync, host_profile, random_config

from fuzzyspec import DecodeConfig
from fuzzyspec.core.engine import Engine
from fuzzyspec.core.kvcache import StaticCache, attention_mask, chain_tree, write_positions
from fuzzyspec.core.step import TargetStep
from fuzzyspec import tuning


def target(device: torch.device, tiny: bool) -> LlamaForCausalLM:
    """A random Llama of TinyLlama's shape (tiny: 2 layers of width 64) with the embedded vocabulary's width."""
    torch.manual_seed(0)
    with device:
        return LlamaForCausalLM(random_config(49152, tiny)).to(
            torch.bfloat16 if device.type == "cuda" else torch.float32).eval()


def products_floor(model, device: torch.device) -> None:
    """Part 1: the pass's weight products alone, as one graph."""
    weights = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        weights += [getattr(attention, "qkv_proj", None), attention.o_proj, getattr(mlp, "gate_up_proj", None),
                    mlp.down_proj]
    weights = [w.weight for w in weights if w is not None] + [model.lm_head.weight]
    inputs = {w.shape[1]: torch.randn(1, 1, w.shape[1], dtype=w.dtype, device=device) for w in weights}

    def run():
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    ms = timed_ms(run, device, graph=True)
    print(f"1. weight products alone ({len(weights)} products, {nbytes / 1e9:.2f} GB): {ms:.3f} ms a pass, "
          f"{nbytes / ms / 1e6:.0f} GB/s", flush=True)


def timed_ms(run, device: torch.device, graph: bool = False, repeats: int = 20) -> float:
    """Median milliseconds of ``run`` (captured as a CUDA graph first where ``graph``)."""
    if graph and device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            run()
        run = captured.replay
    run()
    times = []
    for _ in range(repeats):
        _sync(device)
        clock = time.perf_counter()
        run()
        _sync(device)
        times.append(1000 * (time.perf_counter() - clock))
    return statistics.median(times)


def step_inputs(model, device: torch.device, prefix: int = 128, capacity: int = 256):
    """A cache holding ``prefix`` random tokens and one token's inputs after them: (cache, tokens, positions,
    write, mask)."""
    cache = StaticCache.for_model(model.config, 1, capacity, model.dtype, device)
    tokens = torch.randint(0, model.config.vocab_size, (1, prefix + 1), device=device)
    start = torch.zeros(1, dtype=torch.long, device=device)
    with torch.inference_mode():
        TargetStep(model)(cache, tokens[:, :prefix], write_positions(start, prefix), write_positions(start, prefix),
                          attention_mask(start, chain_tree(1, prefix, device), capacity), None, 1)
    start = torch.tensor([prefix], device=device)
    positions = write_positions(start, 1)
    return cache, tokens[:, prefix:], positions, positions.clone(), attention_mask(start, chain_tree(1, 1, device),
                                                                                    capacity)


def kernels(model, step: TargetStep, device: torch.device, out: Path | None) -> None:
    """Part 2: the compiled forward's kernels, without graphs (``step``)."""
    cache, tokens, positions, write, mask = step_inputs(model, device)
    with torch.inference_mode():
        for _ in range(3):
            step(cache, tokens, positions, write, mask, None, 0, (), compiled=True)
        _sync(device)
        passes = 10
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profiler:
            for _ in range(passes):
                step(cache, tokens, positions, write, mask, None, 0, (), compiled=True)
            _sync(device)
    rows = []
    for event in profiler.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        # (an operator that launches kernels, aten::mm or a Triton kernel's launch, is listed with their device time
        # beside the kernels themselves, which alone spend no host time)
        if device_us > 0 and event.self_cpu_time_total == 0:
            rows.append((device_us / passes, event.count / passes, event.key))
    rows.sort(reverse=True)
    total = sum(us for us, _, _ in rows)
    launches = sum(count for _, count, _ in rows)
    print(f"2. compiled forward, no graphs: {total / 1000:.3f} ms of kernels a pass, {launches:.0f} kernels a pass",
          flush=True)
    for us, count, name in rows[:18]:
        print(f"   {us:8.1f} us  x{count:5.1f}  {name[:110]}")
    if out is not None:
        (out / "kernels.txt").write_text(profiler.key_averages().table(sort_by="self_cuda_time_total"
                                                                       if device.type == "cuda" else "self_cpu_time_total",
                                                                       row_limit=80))


def graph_calls(model, step: TargetStep, plain: TargetStep, device: torch.device) -> None:
    """Parts 3 and 4: a compiled step with inductor's CUDA graphs as the engine calls it (``step``), and the same
    forward compiled without them (``plain``) captured by hand."""
    cache, tokens, positions, write, mask = step_inputs(model, device)
    with torch.inference_mode():
        def call():
            step(cache, tokens, positions, write, mask, None, 0, (), compiled=True)
        for _ in range(3):
            call()
        latency = timed_ms(call, device, repeats=50)
        _sync(device)
        clock = time.perf_counter()
        for _ in range(50):
            call()
        _sync(device)
        queued = 1000 * (time.perf_counter() - clock) / 50
        host = []
        for _ in range(20):
            _sync(device)
            clock = time.perf_counter()
            call()
            host.append(1000 * (time.perf_counter() - clock))
        print(f"3. TargetStep call, inductor's graphs: {latency:.3f} ms synchronised, {queued:.3f} ms a call queued, "
              f"{statistics.median(host):.3f} ms on the host before it returns", flush=True)
        if device.type != "cuda":
            return
        function = plain._compiled_forward().function
        features = tuple(range(model.config.num_hidden_layers + 1))

        def forward():
            return function(cache, tokens, positions, write, mask, None, 0, features)
        by_hand = timed_ms(forward, device, graph=True, repeats=50)
        eager_compiled = timed_ms(forward, device, repeats=50)
        print(f"4. the compiled forward captured by hand: {by_hand:.3f} ms a replay synchronised; "
              f"{eager_compiled:.3f} ms launched kernel by kernel", flush=True)


def engine_ar(model, step: TargetStep, device: torch.device, tokens: int, out: Path | None) -> None:
    """Part 5: the engine's AR over whole answers (``step``), run one step ahead (``Engine.lookahead``) and not,
    interleaved, and a profile of the host's work in one answer run ahead."""
    ids = torch.randint(0, model.config.vocab_size, (1, 40), device=device)
    config = DecodeConfig(method="ar", max_new_tokens=tokens, eos_token_ids=())

    def answer(lookahead: bool) -> None:
        with torch.inference_mode():
            engine = Engine(step, model.config.vocab_size, lookahead=lookahead)
            engine.add(ids, config)
            while engine.rows:
                engine.step()
    times = {True: [], False: []}
    for attempt in range(4):
        for lookahead in (True, False):
            _sync(device)
            clock = time.perf_counter()
            answer(lookahead)
            _sync(device)
            if attempt:
                times[lookahead].append(1000 * (time.perf_counter() - clock) / tokens)
    for lookahead, label in ((True, "run one step ahead"), (False, "not run ahead")):
        print(f"5. engine AR, {tokens} tokens an answer, {label}: {min(times[lookahead]):.3f} ms a token (best of "
              f"3; {', '.join(f'{t:.3f}' for t in times[lookahead])})", flush=True)
    _, text, lines = host_profile(lambda: (answer(True), _sync(device)))
    print("   host, by own time (cProfile, one answer run ahead; its overhead inflates every figure):")
    for line in lines[:19]:
        print("   " + line[:150])
    if out is not None:
        (out / "engine_profile.txt").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    out = Path(args.out) if args.out else None
    print(f"fuzzyspec profile_gpu: {tuning.machine(args.device)}; {time.strftime('%Y-%m-%d')}", flush=True)
    model = target(device, args.tiny)
    graphs, plain = TargetStep(model, compile=True), TargetStep(model, compile=True, graphs=False)  # (fuses the
    # projections on a GPU, as every step of the model does)
    for part in (lambda: products_floor(model, device), lambda: kernels(model, plain, device, out),
                 lambda: graph_calls(model, graphs, plain, device),
                 lambda: engine_ar(model, graphs, device, args.tokens, out)):
        clock = time.perf_counter()
        try:
            part()
        except Exception as error:  # one part failing leaves the others to report
            print(f"   FAILED: {type(error).__name__}: {error}"[:400], flush=True)
        print(f"   ({time.perf_counter() - clock:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
