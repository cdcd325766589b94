"""Linear layers on llama.cpp's own 4-bit and 8-bit weight blocks, through our AVX2 kernel.

A weight row is blocks of 32 consecutive inputs. ``Int4Linear`` holds Q4_0/Q4_1's blocks as the file stores
them: 16 bytes of 4-bit codes (element j the low nibble of byte j, element j + 16 its high nibble) with a
float16 scale and minimum, W[n, k] = q[n, k] * scale[n, k // 32] + minimum[n, k // 32]. ``Int8Linear`` holds
Q8_0's: int8 codes with a float16 scale, W = q * scale. So the weights are exactly the file's.

The products run in ``int4_kernel.cpp``, built on first use on a machine (``available``; kept under the
fuzzyspec cache). As llama.cpp does, it rounds each token's activations to 8 bits per block of 32 and takes
integer dot products with the codes; a token's result does not depend on the other tokens of its batch.
It needs an x86 CPU with AVX2 and a C++ compiler; elsewhere the 4-bit forms are unavailable and floats serve.
"""
from __future__ import annotations

import functools
import hashlib
import platform
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

from ..files import cache_dir

GROUP = 32  # inputs per block (llama.cpp's)
SOURCE = Path(__file__).with_name("int4_kernel.cpp")
# -fopenmp: at::parallel_for runs on torch's threads only where the extension is built with OpenMP;
# -ffp-contract=off: no multiply-adds fused by the compiler, so every tile computes an output alike
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]


@functools.cache
def unavailable() -> str | None:
    """Why the 4-bit kernel cannot run here, or None where it runs (building it on first use on a machine)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return f"the 4-bit kernel needs an x86 CPU with AVX2 (this is {platform.machine()})"
    from torch.utils import cpp_extension

    # The build is this source, with these flags, for this torch: a change to any builds anew, beside the old one.
    built_from = SOURCE.read_bytes() + " ".join(FLAGS).encode() + torch.__version__.encode()
    digest = hashlib.sha256(built_from).hexdigest()[:12]
    name = f"fuzzyspec_int4_{digest}"
    folder = cache_dir() / "kernels" / name
    if not (folder / f"{name}.so").is_file():
        print(f"fuzzyspec: first use on this machine: building the 4-bit kernel (about 15 s; kept in {folder}) ...",
              file=sys.stderr, flush=True)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name, [str(SOURCE)], build_directory=str(folder), is_python_module=False,
                           extra_cflags=FLAGS)
    except Exception as error:  # no compiler, no ninja, an unwritable cache, a failed build: each says so first
        lines = str(error).strip().splitlines()
        return f"the 4-bit kernel could not be built here ({type(error).__name__}: {lines[0] if lines else ''})"
    for op in ("mm_q4", "mm_q8"):  # torch.compile traces the ops by what they return: x [..., K] -> [..., N]
        torch.library.register_fake(f"fuzzyspec_int4::{op}")(
            lambda x, codes, *scales: x.new_empty((*x.shape[:-1], codes.shape[0])))
    return None


def available() -> bool:
    """Whether the 4-bit kernel runs on this machine (see ``unavailable`` for why not)."""
    return unavailable() is None


class Int4Linear(nn.Module):
    """y = x @ W.T (no bias) for W held as Q4 blocks: ``nibbles`` uint8 [N, K/2] (per block of 32 inputs,
    element j in the low nibble of byte j and element j + 16 in the high one), ``scales`` and ``minimums``
    float16 [N, K/32]: W[n, k] = q[n, k] * scales[n, k // 32] + minimums[n, k // 32]."""

    def __init__(self, nibbles: Tensor, scales: Tensor, minimums: Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = nibbles.shape[0], nibbles.shape[1] * 2
        if self.in_features % GROUP or scales.shape != (self.out_features, self.in_features // GROUP) \
                or minimums.shape != scales.shape:
            raise ValueError(f"an int4 weight needs inputs in blocks of {GROUP}, with one scale and minimum a block; "
                             f"got codes {tuple(nibbles.shape)}, scales {tuple(scales.shape)}")
        self.register_buffer("nibbles", nibbles.to(torch.uint8).contiguous())
        self.register_buffer("scales", scales.to(torch.float16).contiguous())
        self.register_buffer("minimums", minimums.to(torch.float16).contiguous())

    @classmethod
    def from_codes(cls, codes: Tensor, scales: Tensor, minimums: Tensor) -> "Int4Linear":
        """``codes`` [N, K] (0..15); ``scales`` and ``minimums`` [N, K/32]."""
        if codes.shape[1] % GROUP:
            raise ValueError(f"an int4 weight needs inputs in blocks of {GROUP}, got {tuple(codes.shape)}")
        blocks = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2, GROUP // 2)
        return cls((blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(codes.shape[0], -1), scales, minimums)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.fuzzyspec_int4.mm_q4(x, self.nibbles, self.scales, self.minimums)

    def codes(self) -> Tensor:
        """The 4-bit codes [N, K] (int32)."""
        blocks = self.nibbles.reshape(self.out_features, -1, 1, GROUP // 2).int()
        return torch.cat([blocks & 0x0F, blocks >> 4], 2).reshape(self.out_features, self.in_features)

    def weight(self) -> Tensor:
        """The float32 weight [N, K] (for checks: a float copy of the weight)."""
        widen = lambda t: t.float().repeat_interleave(GROUP, 1)  # noqa: E731
        return self.codes().float() * widen(self.scales) + widen(self.minimums)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}"


def fuse(linears: list[Int4Linear]) -> Int4Linear:
    """One layer computing every one of ``linears`` (same inputs) at once, their outputs side by side: one kernel
    call where there were several (q, k and v; gate and up), which saves the per-call cost of each. The layers
    keep working alone (transformers' own forward calls them), on views of the fused layer's rows: the codes
    are held once."""
    fused = Int4Linear(*(torch.cat([getattr(linear, name) for linear in linears])
                         for name in ("nibbles", "scales", "minimums")))
    start = 0
    for linear in linears:
        for name in ("nibbles", "scales", "minimums"):
            setattr(linear, name, getattr(fused, name)[start: start + linear.out_features])
        start += linear.out_features
    return fused


def fuse_projections(model: nn.Module) -> None:
    """Give every decoder layer of a Llama-family ``model`` whose q, k and v (gate and up) are all int4 one fused
    layer for them, ``self_attn.qkv_proj`` (``mlp.gate_up_proj``), which our step (``core.step``) calls instead."""
    for layer in model.get_decoder().layers:
        attention, mlp = layer.self_attn, layer.mlp
        if all(isinstance(m, Int4Linear) for m in (attention.q_proj, attention.k_proj, attention.v_proj)):
            attention.qkv_proj = fuse([attention.q_proj, attention.k_proj, attention.v_proj])
        if all(isinstance(m, Int4Linear) for m in (mlp.gate_proj, mlp.up_proj)):
            mlp.gate_up_proj = fuse([mlp.gate_proj, mlp.up_proj])


class Int8Linear(nn.Module):
    """y = x @ W.T (no bias) for W = q[n, k] * scales[n, k // 32], llama.cpp's Q8_0 at its own bytes: ``codes``
    int8 [N, K] and ``scales`` float16 [N, K/32]. ``weight`` is the float W (a tied model's embedding, which
    lookups read anyway): checks compare with it."""

    def __init__(self, codes: Tensor, scales: Tensor, weight: Tensor) -> None:
        super().__init__()
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.to(torch.float16).contiguous())
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.out_features, self.in_features = codes.shape

    @classmethod
    def from_codes(cls, codes: Tensor, scales: Tensor, weight: Tensor | None = None) -> "Int8Linear":
        """``codes`` [N, K] in -128..127, ``scales`` [N, K/32]; ``weight``: the float W if the caller has it."""
        if weight is None:
            weight = codes.float() * scales.to(torch.float16).float().repeat_interleave(GROUP, 1)
        return cls(codes, scales, weight)

    def rows(self, index: Tensor) -> "Int8Linear":
        """The layer of W's rows ``index`` (a drafter's reduced vocabulary), in the same form."""
        return Int8Linear(self.codes.index_select(0, index), self.scales.index_select(0, index),
                          self.weight.detach().index_select(0, index))

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.fuzzyspec_int4.mm_q8(x, self.codes, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}, 8-bit"
