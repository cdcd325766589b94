"""Linear layers on 4-bit weights, through PyTorch's own CPU int4 kernel.

``aten._weight_int4pack_mm_for_cpu`` multiplies activations by a weight stored as 4-bit codes in groups
of 32 consecutive inputs, each group with a scale and an offset::

    W[n, k] = (q[n, k] - 8) * scale[g, n] + offset[g, n]        g = k // 32, q in 0..15

which is exactly the grid of llama.cpp's Q4_0 and Q4_1 blocks (``gguf`` hands them over code for code).
The kernel vectorises bfloat16 activations only, so inputs are cast to bfloat16 for the product and the
result back to the caller's dtype. The packed byte layout depends on the CPU the kernel was built for,
so codes are packed when a model loads, never stored packed.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

GROUP = 32  # inputs per quantization group (llama.cpp's block)


def pack(codes: Tensor) -> Tensor:
    """Codes [N, K] (0..15, int32) -> the kernel's packed uint8 [N, K/2] for this CPU."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)


def available() -> bool:
    """Whether this torch build has the CPU int4 kernel."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class Int4Linear(nn.Module):
    """y = x @ W.T (no bias) with W held as packed 4-bit codes and per-group (scale, offset) in bfloat16.
    ``packed`` [N, K/2] is ``pack``'s; ``scales_and_offsets`` [K/32, N, 2] (the groups first, as the kernel
    takes them)."""

    def __init__(self, packed: Tensor, scales_and_offsets: Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = scales_and_offsets.shape[1], packed.shape[1] * 2
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_offsets", scales_and_offsets.to(torch.bfloat16).contiguous())

    @classmethod
    def from_codes(cls, codes: Tensor, scales: Tensor, offsets: Tensor) -> "Int4Linear":
        """``codes`` [N, K] (0..15, int32); ``scales`` and ``offsets`` [N, K/32], so that
        W[n, k] = (codes[n, k] - 8) * scales[n, k // 32] + offsets[n, k // 32]."""
        out_features, in_features = codes.shape
        if in_features % GROUP or out_features % 16:
            raise ValueError(f"an int4 weight needs inputs in groups of {GROUP} and outputs in multiples of 16, "
                             f"got {out_features}x{in_features}")
        return cls(pack(codes), torch.stack([scales, offsets], -1).transpose(0, 1))

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_and_offsets)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def codes(self) -> Tensor:
        """The 4-bit codes [N, K] (int32), read back through the kernel itself."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        unit = torch.zeros_like(self.scales_and_offsets)
        unit[..., 0], unit[..., 1] = 1.0, 8.0  # (q - 8) * 1 + 8 = q, exact in bfloat16
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, unit).T.round().to(torch.int32)

    def weight(self) -> Tensor:
        """The float32 weight [N, K] the kernel multiplies by (for checks: a float copy of the weight)."""
        scales, offsets = (self.scales_and_offsets[..., i].float().T.repeat_interleave(GROUP, 1) for i in (0, 1))
        return (self.codes().float() - 8) * scales + offsets

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}"


def fuse(linears: list[Int4Linear]) -> Int4Linear:
    """One layer computing every one of ``linears`` (same inputs) at once, their outputs side by side: one kernel
    call where there were several (q, k and v; gate and up), which saves the per-call cost of each.

    The layers keep working alone (transformers' own forward calls them). Where this CPU's packing lays out
    blocks of output rows that the layers' sizes respect (a probe packs random codes of these sizes both ways),
    the fused codes are the layers' packed bytes one after another, and each layer's ``packed`` becomes a view
    into the fused one: no second copy of the codes. Otherwise the codes are read back and packed anew."""
    scales = torch.cat([linear.scales_and_offsets for linear in linears], 1)
    if not _rows_pack_apart(tuple(linear.out_features for linear in linears), linears[0].in_features):
        return Int4Linear(pack(torch.cat([linear.codes() for linear in linears])), scales)
    fused = Int4Linear(torch.cat([linear.packed for linear in linears]), scales)
    start = 0
    for linear in linears:
        linear.packed = fused.packed[start: start + linear.out_features]
        start += linear.out_features
    return fused


@functools.cache
def _rows_pack_apart(sizes: tuple[int, ...], in_features: int) -> bool:
    """Whether layers of these output sizes, packed one after another, are packed as their rows together are
    (a probe with random codes; asked once per shape, as every layer of a model repeats the same few)."""
    probe = [torch.randint(0, 16, (size, in_features), dtype=torch.int32) for size in sizes]
    return torch.equal(pack(torch.cat(probe)), torch.cat([pack(codes) for codes in probe]))


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
    """y = x @ W.T (no bias) for W = scale[n, k // 32] * q[n, k] with q in -128..127: llama.cpp's Q8_0, at its
    own bytes. The int4 kernel does the products: q = 16 h + l with h in -8..7 and l in 0..15, so

        x @ W.T = x @ (16 scale h).T + x @ (scale l).T

    two int4 layers of the same grid (h's codes h + 8 with scale 16 scale and offset 0; l's codes l with scale
    ``scale`` and offset 8 scale), which together read the 8.5 bits per weight Q8_0 stores. ``weight`` is the
    float W (a tied model's embedding, which lookups read anyway): drafters take their output rows from it
    (``rows``), and checks compare with it."""

    def __init__(self, high: Int4Linear, low: Int4Linear, weight: Tensor, scales: Tensor) -> None:
        super().__init__()
        self.high, self.low = high, low
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.register_buffer("scales", scales)  # float32 [N, K/32]: recovers q from ``weight`` exactly
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_codes(cls, codes: Tensor, scales: Tensor, weight: Tensor | None = None) -> "Int8Linear":
        """``codes`` [N, K] int32 in -128..127, ``scales`` [N, K/32] float32; ``weight``: the float W if the
        caller has it (else made here)."""
        high = torch.div(codes, 16, rounding_mode="floor")
        low = codes - 16 * high
        zeros = torch.zeros_like(scales)
        if weight is None:
            weight = codes.float() * scales.repeat_interleave(GROUP, 1)
        return cls(Int4Linear.from_codes(high + 8, 16 * scales, zeros), Int4Linear.from_codes(low, scales, 8 * scales),
                   weight, scales)

    def rows(self, index: Tensor) -> "Int8Linear":
        """The layer of W's rows ``index`` (a drafter's reduced vocabulary), in the same form. W = scale * q is
        exact in float32 (an 11-bit scale times an 8-bit code), so q is recovered exactly from it."""
        scales = self.scales.index_select(0, index)
        weight = self.weight.detach().index_select(0, index)
        wide = scales.repeat_interleave(GROUP, 1)
        codes = torch.where(wide == 0, 0, weight / torch.where(wide == 0, 1, wide)).round().to(torch.int32)
        return Int8Linear.from_codes(codes, scales, weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.high(x) + self.low(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}, 8-bit"
