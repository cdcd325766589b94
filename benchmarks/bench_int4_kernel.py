"""Our 4-bit kernel (fuzzyspec/core/int4_kernel.cpp) against torch's own CPU int4 kernel, at the embedded target's shapes.

For each product of SmolLM2-135M (q|k|v 960x576, o 576x576, gate|up 3072x576, down 576x1536; the Q8_0 LM head
49152x576) and tokens M = 1, 6, 17: microseconds a call, each kernel on the same random weights, interleaved,
median of --repeats; and a whole model's 120 layer products plus the head per token on 30 layers of distinct
weights (so the weights stream from memory, as in decoding). Torch's kernel takes the weights as 4-bit codes with
bfloat16 scales and offsets and bfloat16 activations (``aten._weight_int4pack_mm_for_cpu``); the head is two
4-bit halves there (what fuzzyspec used before its own kernel). Where torchao is installed, its CPU int4 linears run
the layer products beside them: weight-only int4 (``PrototypeInt4WeightOnlyConfig``, torch's kernel behind a tensor
subclass) and, where its build has the kernel, 8-bit dynamic activations with int4 weights (da8w4, as llama.cpp and
ours multiply); each quantizes the same weights itself. The error columns are each kernel's relative error against
the float32 product with the same weights.

Usage: python benchmarks/bench_int4_kernel.py [--threads 2] [--repeats 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from fuzzyspec.core import int4, kernels
from fuzzyspec.loading import cpu_isa

SHAPES = {"q|k|v": (960, 576), "o": (576, 576), "gate|up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)


class TorchInt4:
    """torch's int4 kernel on the same grid: W = (q - 8) * scale + offset, scale and offset in bfloat16."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> None:
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int().contiguous(), 1)
        offsets = minimums.float() + 8 * scales.float()
        self.scales = torch.stack([scales.float(), offsets], -1).transpose(0, 1).to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, 32, self.scales).float()


class TorchInt8:
    """torch's int4 kernel on a Q8_0 weight as two 4-bit halves (q = 16 h + l)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        high = torch.div(codes.int(), 16, rounding_mode="floor")
        scales = scales.float()
        self.high = TorchInt4(high + 8, 16 * scales, -128 * scales)
        self.low = TorchInt4(codes.int() - 16 * high, scales, torch.zeros_like(scales))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.high(x) + self.low(x)


def torchao_linears(weight: torch.Tensor) -> dict:
    """torchao's CPU int4 linears of ``weight`` (float32, [out, in]) by name, those this install has."""
    try:
        from torchao.prototype.quantization.int4.inference_workflow import (
            Int8DynamicActivationInt4WeightConfig, PrototypeInt4WeightOnlyConfig)
        from torchao.quantization import quantize_
    except ImportError:
        return {}
    configs = {"torchao w4": (PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False), torch.bfloat16)}
    if "CPU" in torch._C._dispatch_dump("torchao::da8w4_linear_cpu"):  # (not in the PyPI wheel as of 0.18)
        configs["torchao da8w4"] = (Int8DynamicActivationInt4WeightConfig(group_size=32, set_inductor_config=False),
                                    torch.bfloat16)
    linears = {}
    for name, (config, dtype) in configs.items():
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=dtype)
        linear.weight.data.copy_(weight)
        quantize_(linear, config)
        linears[name] = lambda x, linear=linear, dtype=dtype: linear(x.to(dtype)).float()
    return linears


def random_int4(out_features: int, in_features: int, generator: torch.Generator):
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    scales = (torch.rand(out_features, in_features // 32, generator=generator) * 0.02).half()
    minimums = (-torch.rand(out_features, in_features // 32, generator=generator) * 0.1).half()
    return int4.Int4Linear.from_codes(codes, scales, minimums), TorchInt4(codes, scales, minimums)


def random_int8(generator: torch.Generator):
    codes = torch.randint(-127, 128, HEAD, generator=generator)
    scales = (torch.rand(HEAD[0], HEAD[1] // 32, generator=generator) * 0.01).half()
    return int4.Int8Linear.from_codes(codes, scales), TorchInt8(codes, scales)


def timed(call, repeats: int) -> float:
    """Median microseconds of ``call()``."""
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y - reference).norm() / reference.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit(f"bench_int4_kernel: {kernels.unavailable()}")
    generator = torch.Generator().manual_seed(0)
    print(f"bench_int4_kernel: {cpu_isa()} (kernel built for {kernels.isa()}), {args.threads} threads, torch {torch.__version__}; "
          f"us a call (median of {args.repeats}), ours against torch's int4 kernel")
    layers = {name: random_int4(*shape, generator) for name, shape in SHAPES.items()}
    head = random_int8(generator)
    others = {name: torchao_linears(ours.weight()) for name, (ours, _) in layers.items()}
    extra = sorted({label for linears in others.values() for label in linears})
    print("  torchao: " + (", ".join(extra) + " (layer products; us, x ours, err)" if extra else
                           "not installed" if not _has_torchao() else "no CPU int4 linear in this build"))
    print(f"  {'product':10} {'M':>3} {'ours us':>9} {'torch us':>9} {'speedup':>8} {'ours err':>9} {'torch err':>9}"
          + "".join(f"  {label:>22}" for label in extra))
    for name, (ours, theirs) in [*layers.items(), ("head Q8_0", head)]:
        weight = ours.weight() if isinstance(ours, int4.Int4Linear) else ours.weight
        for tokens in (1, 6, 17):
            x = torch.randn(tokens, ours.in_features, generator=generator)
            repeats = args.repeats if name != "head Q8_0" else max(args.repeats // 10, 5)
            mine, torchs = timed(lambda: ours(x), repeats), timed(lambda: theirs(x), repeats)
            reference = x @ weight.T
            columns = ""
            for label in extra:
                linear = others.get(name, {}).get(label)
                if linear is None:
                    columns += f"  {'-':>22}"
                    continue
                theirs_us = timed(lambda: linear(x), repeats)
                columns += f"  {theirs_us:8.1f} {theirs_us / mine:5.2f}x {error(linear(x), reference):6.4f}"
            print(f"  {name:10} {tokens:3d} {mine:9.1f} {torchs:9.1f} {torchs / mine:7.2f}x "
                  f"{error(ours(x), reference):9.4f} {error(theirs(x), reference):9.4f}" + columns)
    # A token's products over 30 layers of distinct weights (about 60 MB of 4-bit codes) plus the head.
    model = [[random_int4(*shape, generator) for shape in SHAPES.values()] for _ in range(30)]
    inputs = {k: torch.randn(1, k, generator=generator) for k in (576, 1536)}
    for label, pick in (("ours", 0), ("torch", 1)):
        def token() -> None:
            for layer in model:
                for pair in layer:
                    pair[pick](inputs[pair[0].in_features])
            head[pick](inputs[576])
        print(f"  one token's 120 layer products and the head ({label}): {timed(token, 20) / 1000:.2f} ms")


def _has_torchao() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


if __name__ == "__main__":
    main()
