"""Check the CUDA paths on a GPU machine (not part of CI, which has no GPU).

1. Correctness on CUDA with tiny random Llamas: greedy SD equals HF greedy
   generate; AR equals HF; FSD-hybrid at T = 0 equals SD under one seed; FSD at
   T = inf equals the draft decoding alone; seeded sampling is reproducible.
2. Compiled steps captured as CUDA graphs equal eager steps token for token (AR, chains, EAGLE trees; one
   row and two rows together; a longer row joining midway, so that the cache grows under the graphs).
   ``waits``: an EAGLE tree step waits for the device once (``torch.cuda.set_sync_debug_mode``).
3. An EAGLE row that the cost schedule holds back now and then (its steps then run ahead, as AR's do) gives AR's
   tokens; AR rows run ahead, the last slot's ending first, each get their tokens alone.
4. Loading on ``device="cuda"`` and ``device="auto"`` (device_map="auto").
5. Loop overhead on the GPU: our AR against HF ``generate`` on a ~1B-parameter
   random Llama in bfloat16 (random weights: only speed is meaningful here).

Usage: python benchmarks/cuda_check.py [cuda|cpu] [PARTS], PARTS a comma-separated choice of correctness, compiled,
trees (compiled's EAGLE trees alone), waits, held, loading, overhead (default: all but trees, in that order; on the
CPU, a smoke test of the script: correctness, compiled and held). On an H100 the first two took most of 170 s
together (2026-11-28); on an H200 ``compiled`` did not finish in 150 s (its AR and chains did). Each part prints its
time.
"""
from __future__ import annotations

import itertools
import math
import sys
from dataclasses import replace
import tempfile
import time
import warnings
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fuzzyspec import DecodeConfig, ModelDrafter, ModelPair, Sampling, decode  # noqa: E402
from fuzzyspec.core import engine as engine_module  # noqa: E402
from fuzzyspec.core import graphs as graphs_module  # noqa: E402
from fuzzyspec.core.engine import Engine, decode_batch  # noqa: E402
from fuzzyspec.core.step import TargetStep  # noqa: E402
from fuzzyspec.drafters.eagle import EagleDrafter, head_logits  # noqa: E402
from fuzzyspec.drafters.eagle_head import EagleHead  # noqa: E402

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"  # "cpu": a smoke test of the script itself
failures: list[str] = []


def check(name: str, ok: bool) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}")
    if not ok:
        failures.append(name)


def llama(vocab: int, hidden: int, layers: int, seed: int, dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2 if hidden < 512 else
                         hidden * 4, num_hidden_layers=layers, num_attention_heads=max(4, hidden // 64),
                         num_key_value_heads=max(2, hidden // 256), max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(DEVICE):  # a 1B model's random init on the host takes a while
        model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20 if hidden < 512 else 1)
    return model


def run(target, draft, prompt, **options):
    sampling = Sampling(**{k: options.pop(k) for k in ("temperature", "top_k", "top_p") if k in options})
    config = DecodeConfig(sampling=sampling, **options)
    vocab = target.config.vocab_size
    drafter = ModelDrafter(draft, vocab) if draft is not None else None
    tokens, stats = decode(target, drafter, torch.tensor([prompt], device=DEVICE), config, vocab)
    return tokens[0].tolist(), stats


def correctness() -> None:
    target = llama(256, 64, 2, seed=0)
    draft = llama(256, 64, 2, seed=0)
    draft.load_state_dict(target.state_dict())
    g = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        for w in draft.parameters():
            if w.numel() > 1:
                w.add_((torch.randn(w.shape, generator=g) * 0.3 * w.std().item()).to(DEVICE))
    for prompt in ([1, 5, 9, 3], [7], list(range(20, 60))):
        ids = torch.tensor([prompt], device=DEVICE)
        expected = target.generate(ids, max_new_tokens=48, do_sample=False)[0, len(prompt):].tolist()
        sd, stats = run(target, draft, prompt, method="sd", gamma=4, max_new_tokens=48)
        ar, _ = run(target, None, prompt, method="ar", max_new_tokens=48)
        check(f"greedy sd == HF greedy (prompt len {len(prompt)}, accepted {stats.accepted}/{stats.proposed})",
              sd == expected)
        check(f"greedy ar == HF greedy (prompt len {len(prompt)})", ar == expected)
    common = dict(temperature=1.0, top_p=0.95, gamma=4, max_new_tokens=48, divergence="kl_pq")
    for seed in range(3):
        a, _ = run(target, draft, [1, 2, 3], method="sd", seed=seed, **common)
        b, _ = run(target, draft, [1, 2, 3], method="fsd-hybrid", threshold=0.0, seed=seed, **common)
        c, _ = run(target, draft, [1, 2, 3], method="sd", seed=seed, **common)
        check(f"sampled fsd-hybrid T=0 == sd, reproducible (seed {seed})", a == b == c)
    handed = []
    decode(target, None, torch.tensor([[1, 2, 3]], device=DEVICE), DecodeConfig(method="ar", max_new_tokens=6), 256,
           on_tokens=lambda new: handed.append(new.device.type) and False)
    check(f"a callback gets its tokens on the host (nothing waits for the step queued ahead): {set(handed)}",
          handed == ["cpu"] * 6)
    for temperature in (0.0, 1.0):
        fuzzy, stats = run(target, draft, [4, 4], method="fsd", threshold=math.inf, seed=5,
                           temperature=temperature, max_new_tokens=40)
        alone, _ = run(draft, None, [4, 4], method="ar", seed=5, temperature=temperature, max_new_tokens=40)
        check(f"fsd T=inf == draft alone (temperature {temperature})", fuzzy == alone and stats.target_forwards == 0)


def tiny_target():
    """The compiled checks' tiny float32 target, a random EAGLE head for it and the module its logits read, and the
    target's step eager and compiled (captured as CUDA graphs on a GPU)."""
    target = llama(256, 64, 2, seed=0)
    head = EagleHead.for_target(target).to(DEVICE).eval()
    return target, head, head_logits(head, target), TargetStep(target), TargetStep(target, compile=True)


def compiled(only: tuple[str, ...] = ()) -> None:
    """Compiled steps captured as CUDA graphs give the eager steps' tokens (float32): AR, chains and EAGLE trees
    (their growth captured from a shape's third), one row and two rows of different lengths decoded together, and a
    longer row joining midway (the cache grows). ``only``: these cases alone."""
    target, head, logits, eager, graphs = tiny_target()
    draft = llama(256, 64, 1, seed=3)
    if DEVICE != "cpu":
        check("a compiled CUDA step is captured as CUDA graphs", graphs.graphs)
    prompts = [torch.tensor([list(range(3, 12))], device=DEVICE), torch.tensor([[7, 1]], device=DEVICE)]
    cases = {"ar": (None, dict(method="ar")), "chain sd": ("draft", dict(method="sd", gamma=4)),
             "eagle trees sd": ("eagle", dict(method="sd", tree=True, tree_total_tokens=12, tree_depth=4)),
             "chain fsd-hybrid": ("draft", dict(method="fsd-hybrid", threshold=0.3, gamma=3))}
    for name, (kind, options) in cases.items():
        if only and name not in only:
            continue
        config = DecodeConfig(max_new_tokens=300, gamma_schedule="constant", **options)  # past the first capacity

        def drafter():
            if kind is None:
                return None
            return ModelDrafter(draft, 256) if kind == "draft" else EagleDrafter(head, target, 256, logits)
        runs = {}
        for label, step in (("eager", eager), ("graphs", graphs)):
            alone = [decode(step, drafter(), ids, config, 256)[0][0].tolist() for ids in prompts]
            batch = [tokens for tokens, _ in decode_batch(step, prompts, [config] * 2, [drafter(), drafter()], 256)]
            # a row joining midway with a longer answer: the cache grows (new tensors) under running graphs
            engine = Engine(step, 256)
            first = engine.add(prompts[0], replace(config, max_new_tokens=40), drafter())
            for _ in range(5):
                engine.step()
            second = engine.add(prompts[1], replace(config, max_new_tokens=600), drafter())
            while engine.rows:
                engine.step()
            runs[label] = (alone, batch, [first.tokens, second.tokens])
        check(f"{name}: compiled with CUDA graphs == eager (alone, batched, joining)", runs["graphs"] == runs["eager"])
        check(f"{name}: batched == alone", runs["eager"][0] == runs["eager"][1])


def waits() -> None:
    """An EAGLE tree step through CUDA graphs waits for the device once, for its outcome: the tree is grown on the
    device (since 2026-11-28 as one captured graph) and its shape read with the outcome
    (``torch.cuda.set_sync_debug_mode`` warns at every wait). A step that captures a graph (a cache grown to new
    tensors, a shape met first) waits more: ``core.graphs`` waits for the device before a capture, as
    ``torch.cuda.graph`` does."""
    if DEVICE == "cpu":
        print("(a GPU's check: nothing waits on the CPU)")
        return
    target, head, logits, _, graphs = tiny_target()
    engine = Engine(graphs, 256)
    config = DecodeConfig(method="sd", tree=True, tree_total_tokens=12, tree_depth=4, gamma_schedule="constant",
                          max_new_tokens=300)
    engine.add(torch.tensor([list(range(3, 12))], device=DEVICE), config, EagleDrafter(head, target, 256, logits))
    for _ in range(3):  # (the first steps compile and capture)
        engine.step()
    captures = []
    capture = graphs_module.Graphs._capture

    def counted(self, *arguments):
        captures[-1] += 1
        return capture(self, *arguments)

    per_step = []
    graphs_module.Graphs._capture = counted
    try:
        for _ in range(10):
            captures.append(0)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    engine.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            per_step.append(sum("synchroniz" in str(warning.message) for warning in caught))
    finally:
        graphs_module.Graphs._capture = capture
    plain = [count for count, captured in zip(per_step, captures) if not captured]
    check(f"an EAGLE tree step through CUDA graphs waits for the device once (waits a step: {per_step}; graphs "
          f"captured a step: {captures})", len(plain) >= 7 and set(plain) == {1})


def held() -> None:
    """An EAGLE row that the cost schedule holds back now and then (its steps then run ahead on a GPU, feeding the
    head the target's features) gives AR's tokens, eager and through CUDA graphs."""
    target, head, logits, eager, graphs = tiny_target()
    prompt = torch.tensor([list(range(3, 12))], device=DEVICE)
    # a scripted schedule: two plans holding the row back (its steps run ahead on a GPU, feeding the head the
    # target's features), then one drafting 2 tokens
    sizes, planned = itertools.cycle([0, 0, 2]), engine_module.plan
    engine_module.plan = lambda options, *_, **__: [(next(sizes), 1)] * len(options)
    try:
        config = DecodeConfig(method="sd", gamma=3, gamma_schedule="cost", max_new_tokens=300)
        for label, step in (("eager", eager), ("graphs", graphs)):
            tokens, stats = decode(step, EagleDrafter(head, target, 256, logits), prompt, config, 256)
            ar = decode(step, None, prompt, DecodeConfig(method="ar", max_new_tokens=300), 256)[0]
            check(f"eagle chain sd held back now and then ({label}, drafted {stats.proposed}): == AR",
                  tokens[0].tolist() == ar[0].tolist() and stats.proposed > 0)
    finally:
        engine_module.plan = planned
    # AR rows run ahead (a GPU's default), the last slot's ending first: its slot leaves while a pass queued for it
    # is still to be read (it raised IndexError before 2026-11-28)
    configs = [DecodeConfig(method="ar", max_new_tokens=40), DecodeConfig(method="ar", max_new_tokens=9)]
    prompts = [prompt, torch.tensor([[7, 1]], device=DEVICE)]
    for label, step in (("eager", eager), ("graphs", graphs)):
        engine = Engine(step, 256)
        rows = [engine.add(ids, config) for ids, config in zip(prompts, configs)]
        while engine.rows:
            engine.step()
        check(f"ar rows run ahead, the last slot's ending first ({label}): each as alone",
              all(row.tokens == decode(step, None, ids, config, 256)[0][0].tolist()
                  for row, ids, config in zip(rows, prompts, configs)))


def loading() -> None:
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(255)} | {"<unk>": 255}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="w0")
    with tempfile.TemporaryDirectory() as folder:
        llama(256, 64, 2, seed=0).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        for device in ("cuda", "auto"):
            pair = ModelPair.load(folder, "self:1", dtype="auto", device=device)
            result = pair.generate("w1 w2 w3", chat=False, method="fsd", threshold=0.3, max_new_tokens=16)
            where = {str(p.device) for p in pair.target.parameters()}
            check(f"load device={device}: dtype {pair.target.dtype}, on {sorted(where)}, "
                  f"{result.stats.new_tokens} tokens", result.stats.new_tokens > 0 and "cpu" not in where)


def overhead() -> None:
    target = llama(32000, 2048, 16, seed=0, dtype=torch.bfloat16)
    prompt = list(range(100, 164))
    ids = torch.tensor([prompt], device=DEVICE)
    n = 128
    target.generate(ids, max_new_tokens=8, do_sample=False)
    run(target, None, prompt, method="ar", max_new_tokens=8)
    timings = {}
    for name in ("hf", "ours", "hf", "ours"):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if name == "hf":
            target.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        else:
            run(target, None, prompt, method="ar", max_new_tokens=n)
        torch.cuda.synchronize()
        timings.setdefault(name, []).append(n / (time.perf_counter() - start))
    hf, ours = max(timings["hf"]), max(timings["ours"])
    print(f"AR on a random 1B Llama, bf16, {n} tokens: HF generate {hf:.1f} tok/s, ours {ours:.1f} tok/s "
          f"(ratio {ours / hf:.2f})")


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(0) if DEVICE != "cpu" else "cpu")
    parts = {"correctness": correctness, "compiled": compiled, "trees": lambda: compiled(("eagle trees sd",)),
             "waits": waits, "held": held, "loading": loading, "overhead": overhead}
    chosen = sys.argv[2].split(",") if len(sys.argv) > 2 else [name for name in parts if name != "trees"] \
        if DEVICE != "cpu" else ["correctness", "compiled", "held"]
    unknown = [name for name in chosen if name not in parts]
    if unknown:
        sys.exit(f"cuda_check: unknown part(s) {', '.join(unknown)}; choose from {', '.join(parts)}")
    for name in chosen:
        clock = time.perf_counter()
        parts[name]()
        print(f"-- {name}: {time.perf_counter() - clock:.0f} s")
    print("all CUDA checks passed" if not failures else f"{len(failures)} CUDA checks FAILED")
    sys.exit(1 if failures else 0)
