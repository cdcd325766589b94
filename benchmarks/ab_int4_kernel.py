"""Our 4-bit kernel against the kernel of another commit, A/B in one process: each product of the embedded target's
shapes at 1-17 tokens, a whole model's products streaming from memory, the target's eager step at a few widths,
and eager decoding (AR and the default job) of everyday prompts, every configuration interleaved.

Both kernels (``fuzzyspec/core/int4_kernel.cpp`` of the working tree and of ``--before``, each with the extension's
other files of its commit) are built for this machine's instruction set (or FUZZYSPEC_INT4_ISA's) under op and C++
namespaces of their own, and the model's 4-bit layers are pointed at one or the other between calls (eager steps
look their op up at each call). The two kernels must give the same numbers bit for bit (checked on every product),
so only time differs. To see the AVX2 class on a wider CPU: ``ATEN_CPU_CAPABILITY=avx2 FUZZYSPEC_INT4_ISA=avx2``.

Usage: python benchmarks/ab_int4_kernel.py [--before 62c50b8] [--prompts 16] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int4_kernel import SHAPES, random_int4, random_int8  # noqa: E402 (this folder's modules)
from bench_step import everyday  # noqa: E402
from turns import balanced_turns  # noqa: E402

from fuzzyspec import tuning  # noqa: E402
from fuzzyspec.api import ModelPair  # noqa: E402
from fuzzyspec.core import kernels  # noqa: E402
from fuzzyspec.core.cost import Profile  # noqa: E402
from fuzzyspec.core.step import TargetStep  # noqa: E402
from fuzzyspec.files import cache_dir  # noqa: E402
from fuzzyspec.loading import cpu_isa  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "fuzzyspec/core/int4_kernel.cpp"
COMMON = {"max_new_tokens": 128, "eos_token_ids": ()}


# The extension's files since the kernels were split (0c21715): ops.cpp registers every op, the kernels' files hold
# plain C++. Before, each kernel's file registered its own ops and was built alone.
SPLIT = ("fuzzyspec/core/ops.cpp", "fuzzyspec/core/int4_kernel.cpp", "fuzzyspec/core/layer_kernel.cpp",
         "fuzzyspec/core/kernels.h")
NAMESPACES = ("fuzzyspec_int4", "fuzzyspec_attention", "fuzzyspec_layer")


def sources_at(source: str, commit: str | None) -> dict[str, str]:
    """The files to build for the kernel file ``source`` at ``commit`` (None: the working tree), by file name:
    every file of the extension where the commit has the split layout, else ``source`` alone."""
    def read(path: str) -> str:
        if commit is None:
            return (ROOT / path).read_text()
        return subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout

    split = commit is None or subprocess.run(["git", "cat-file", "-e", f"{commit}:{SPLIT[0]}"], cwd=ROOT,
                                             capture_output=True).returncode == 0
    return {Path(path).name: read(path) for path in (SPLIT if split else (source,))}


def build(tag: str, files: dict[str, str]) -> dict[str, object]:
    """The kernel ``files`` (name: text) built as one extension whose op namespaces and C++ namespace are renamed to
    ``ab_<tag>_<isa>...``, so it loads beside the working tree's; {original op namespace: its ops}."""
    from torch.utils import cpp_extension

    name = f"ab_{tag}_{kernels.isa().replace('-', '_')}"
    folder = cache_dir() / "ab_kernels" / name
    folder.mkdir(parents=True, exist_ok=True)
    renamed = {namespace: f"{name}_{index}" for index, namespace in enumerate(NAMESPACES)}
    found = set()
    for file, text in files.items():
        for namespace, new in renamed.items():
            if namespace in text:
                found.add(namespace)
                text = text.replace(namespace, new)
        text = text.replace("namespace fuzzyspec", f"namespace {name}").replace("fuzzyspec::", f"{name}::")
        path = folder / file
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
    cpp_extension.load(name, [str(folder / file) for file in files if file.endswith(".cpp")],
                       build_directory=str(folder), is_python_module=False, extra_cflags=kernels.build_flags())
    return {namespace: getattr(torch.ops, renamed[namespace]) for namespace in sorted(found)}


def before_and_after(source: str, before: str, namespace: str = "fuzzyspec_int4", prefix: str = "") -> dict:
    """The kernel file ``source`` (a path in the repository) of commit ``before`` and of the working tree, each built
    with op namespaces of its own (``build``): {"before": the ops of its ``namespace``, "after": the same}."""
    return {"before": build(prefix + "before", sources_at(source, before))[namespace],
            "after": build(prefix + "after", sources_at(source, None))[namespace]}


def use(namespace) -> None:
    """Point every 4-bit layer's op lookup (``torch.ops.fuzzyspec_int4``) at ``namespace``."""
    torch.ops.fuzzyspec_int4 = namespace


def interleaved(run, tags: tuple[str, ...], repeats: int) -> dict[str, float]:
    """Median seconds of ``run(tag)`` per tag, the tags taking turns (in alternating order) ``repeats`` times."""
    times = {tag: [] for tag in tags}
    for repeat in range(repeats):
        for tag in (tags if repeat % 2 else tags[::-1]):
            start = time.perf_counter()
            run(tag)
            times[tag].append(time.perf_counter() - start)
    return {tag: statistics.median(spent) for tag, spent in times.items()}


def products(kernels_by_tag: dict, generator: torch.Generator) -> None:
    print("products: us a call, median, the two interleaved")
    layers = {name: (random_int4(*shape, generator)[0], "mm_q4") for name, shape in SHAPES.items()}
    for name, (layer, op) in [*layers.items(), ("head Q8_0", (random_int8(generator)[0], "mm_q8"))]:
        k = layer.in_features
        calls = {tag: getattr(namespace, op) for tag, namespace in kernels_by_tag.items()}
        for tokens in (1, 2, 4, 6, 17):
            x = torch.randn(tokens, k, generator=generator)
            before, after = (calls[tag](x, layer.packed) for tag in ("before", "after"))
            if not torch.equal(before, after):
                raise SystemExit(f"ab_int4_kernel: the kernels' {name} products differ at {tokens} tokens")
            medians = interleaved(lambda tag: calls[tag](x, layer.packed), ("before", "after"),
                                  400 if op == "mm_q4" else 40)
            old, new = medians["before"] * 1e6, medians["after"] * 1e6
            print(f"  {name:10s} {tokens:3d} tokens  before {old:8.1f}  after {new:8.1f}  before/after {old / new:.2f}x",
                  flush=True)


def streaming(kernels_by_tag: dict, generator: torch.Generator) -> None:
    """A whole model's products per pass of M tokens, on 30 layers of distinct weights and the head: as in
    decoding, the weights stream from memory (one layer's fit in the caches, and the products above reread them
    there)."""
    print("a whole model's products (30 layers' and the head's, distinct weights): ms a pass, median, interleaved")
    model = [[random_int4(*shape, generator)[0] for shape in SHAPES.values()] for _ in range(30)]
    head = random_int8(generator)[0]
    for tokens in (1, 2, 3, 4, 6, 8, 17):
        x = {k: torch.randn(tokens, k, generator=generator) for k in (576, 1536)}

        def one_pass(namespace) -> None:
            for layers in model:
                for layer in layers:
                    namespace.mm_q4(x[layer.in_features], layer.packed)
            namespace.mm_q8(x[576], head.packed)
        medians = interleaved(lambda tag: one_pass(kernels_by_tag[tag]), ("before", "after"), 40)
        old, new = medians["before"] * 1e3, medians["after"] * 1e3
        print(f"  {tokens:3d} tokens  before {old:6.2f}  after {new:6.2f}  before/after {old / new:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="62c50b8", help="the commit whose kernel is the baseline")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit(f"ab_int4_kernel: {kernels.unavailable()}")
    namespaces = before_and_after(SOURCE, args.before)
    print(f"ab_int4_kernel: CPU {cpu_isa()}; kernels built for {kernels.isa()}; torch's code for "
          f"{torch.backends.cpu.get_cpu_capability()}; {args.threads} threads; torch {torch.__version__}; "
          f"before: {args.before}, after: the working tree; {time.strftime('%Y-%m-%d')}")
    products(namespaces, torch.Generator().manual_seed(0))
    streaming(namespaces, torch.Generator().manual_seed(1))

    pair = ModelPair.load(draft=None, weights="int4")
    step = TargetStep(pair.target, compile=False)
    job = ModelPair(pair.target, pair.tokenizer, pair.with_drafter("default").draft, step, None)
    widths = (1, 2, 4, 6, 17)
    curves = {tag: [] for tag in namespaces}
    for repeat in range(3):
        for tag in (("before", "after") if repeat % 2 == 0 else ("after", "before")):
            use(namespaces[tag])
            curves[tag].append(tuning.measure_target(step, widths, compiled=False)[0])
    print("eager step of k tokens after 128: ms, median of 3 measurements each (x k = 1)")
    for tag, measured in curves.items():
        ms = {w: statistics.median(times[w] for times in measured) for w in widths}
        print(f"  {tag:6s} " + "  ".join(f"{w}:{ms[w]:.2f}(x{ms[w] / ms[1]:.2f})" for w in widths))

    variants = [(kind, tag) for kind in ("ar", "default") for tag in namespaces]
    start = step.profile.to_dict()
    profiles = {variant: Profile.from_dict(start) for variant in variants}  # each measures its own costs

    def run(variant: tuple[str, str], ids: torch.Tensor):
        use(namespaces[variant[1]])
        step.profile = profiles[variant]
        return job.generate(ids, **(COMMON | ({"method": "ar"} if variant[0] == "ar" else {}))).stats

    prompts = everyday(args.prompts)
    for variant in variants:  # warm: each variant's first steps measure its profile's sizes
        run(variant, job.encode(prompts[0][1]))
    totals = {variant: {"tokens": 0, "seconds": 0.0, "passes": 0, "by_category": {}} for variant in variants}
    for index, ((category, prompt), order) in enumerate(zip(prompts, balanced_turns(variants, len(prompts)))):
        ids = job.encode(prompt)
        for variant in order:
            clock = time.perf_counter()
            stats = run(variant, ids)
            seconds = time.perf_counter() - clock
            total = totals[variant]
            total["tokens"] += stats.new_tokens
            total["seconds"] += seconds
            total["passes"] += stats.target_forwards
            made = total["by_category"].setdefault(category, [0, 0.0])
            made[0] += stats.new_tokens
            made[1] += seconds
        print(f"ab_int4_kernel: prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)

    def rate(made: list) -> float:
        return made[0] / made[1]

    print(f"eager decoding: {len(prompts)} everyday prompts x {COMMON['max_new_tokens']} tokens, greedy, interleaved")
    for kind, tag in variants:
        total, ar = totals[(kind, tag)], totals[("ar", tag)]
        speed = total["tokens"] / total["seconds"]
        categories = {c: rate(made) / rate(ar["by_category"][c]) for c, made in total["by_category"].items()}
        print(f"  {kind:8s} {tag:6s} {speed:7.1f} tok/s  x AR of the same kernel "
              f"{speed / (ar['tokens'] / ar['seconds']):.3f}  tok/pass {total['tokens'] / total['passes']:.2f}  "
              f"categories x AR {min(categories.values()):.3f}-{max(categories.values()):.3f}")
    for kind in ("ar", "default"):
        after, before = totals[(kind, "after")], totals[(kind, "before")]
        print(f"  {kind}: after / before "
              f"{(after['tokens'] / after['seconds']) / (before['tokens'] / before['seconds']):.3f}x")


if __name__ == "__main__":
    main()
