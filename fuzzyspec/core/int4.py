"""Linear layers on llama.cpp's own 4-bit and 8-bit weight blocks, through our kernel.

A weight row is blocks of 32 consecutive inputs. ``Int4Linear`` holds Q4_0/Q4_1's blocks: 4-bit codes with a
float16 scale and minimum per block, W[n, k] = q[n, k] * scale[n, k // 32] + minimum[n, k // 32].
``Int8Linear`` holds Q8_0's: int8 codes with a float16 scale, W = q * scale. So the weights are exactly the
file's; only their order changes: the kernel reads rows in groups of 16, each block's codes of the 16 rows
interleaved four at a time (``pack_four``, ``pack_eight``; the layout is described in ``int4_kernel.cpp``).

The products run in ``int4_kernel.cpp``, one of our CPU kernels (``core.kernels``: built on first use on a
machine for the widest instructions it has, kept under the fuzzyspec cache). As llama.cpp does, it rounds each token's
activations to 8 bits per block of 32 and takes integer dot products with the codes; a token's result does not
depend on the other tokens of its batch. It needs an x86 CPU with AVX2 and a C++ compiler; elsewhere the 4-bit
forms are unavailable and floats serve.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from . import kernels
from .kernels import ROWS

GROUP = 32  # inputs per block (llama.cpp's)
ROUNDING_ROWS = 1024  # rows ``Int4Linear.rounded`` rounds at a time (whole groups of ``ROWS``)


def nibble_codes(nibbles: Tensor) -> Tensor:
    """GGUF's Q4 nibbles [N, K/2] (per block of 32 inputs, element j in the low nibble of byte j and element
    j + 16 in the high one) -> the codes [N, K] (int32, 0..15)."""
    blocks = nibbles.reshape(nibbles.shape[0], -1, 1, GROUP // 2).int()
    return torch.cat([blocks & 0x0F, blocks >> 4], 2).reshape(nibbles.shape[0], -1)


def dequantize(codes: Tensor, scales: Tensor, minimums: Tensor | None = None) -> Tensor:
    """The float32 weight q * scale (+ minimum) of codes [N, K] with per-block scales (minimums) [N, K/32]."""
    weight = codes.float() * scales.float().repeat_interleave(GROUP, 1)
    return weight if minimums is None else weight + minimums.float().repeat_interleave(GROUP, 1)


def _grouped(t: Tensor) -> Tensor:
    """[N, ...] -> [N/16, 16, ...], padded with zero rows to a multiple of 16."""
    padding = -t.shape[0] % ROWS
    if padding:
        t = torch.cat([t, t.new_zeros((padding, *t.shape[1:]))])
    return t.reshape(-1, ROWS, *t.shape[1:])


def _per_block(values: Tensor) -> Tensor:
    """[N, K/32] of one value per row and block -> [N/16, K/32, bytes]: each block's 16 rows' values, as bytes."""
    return _grouped(values).transpose(1, 2).contiguous().view(torch.uint8).reshape(
        -(-values.shape[0] // ROWS), values.shape[1], -1)


def pack_four(nibbles: Tensor, scales: Tensor, minimums: Tensor) -> Tensor:
    """Q4 blocks as GGUF stores them (``nibbles`` uint8 [N, K/2]: per block of 32 inputs, code c in the low nibble
    of byte c and code 16 + c in the high one), float16 scales and minimums [N, K/32] -> the kernel's bytes
    [N/16, K/32, 320]: per group of 16 rows and block, for j = 0..3, 64 bytes holding row i's codes 4j..4j+3 in
    the low nibbles and 16+4j..16+4j+3 in the high ones (byte 4i + c), then the 16 scales and the 16 minimums.
    That byte 4i + c of chunk j is byte 4j + c of row i's block in the file, so packing moves whole bytes."""
    blocks = _grouped(nibbles.reshape(nibbles.shape[0], -1, 4, 4))  # [G, 16, b, j, c]
    interleaved = blocks.permute(0, 2, 3, 1, 4).reshape(blocks.shape[0], blocks.shape[2], -1)  # [G, b, j*16*c]
    return torch.cat([interleaved, _per_block(scales.to(torch.float16)), _per_block(minimums.to(torch.float16))],
                     -1)


def nibbles_of(codes: Tensor) -> Tensor:
    """Codes [N, K] (0..15) -> GGUF's nibbles [N, K/2] (``pack_four``)."""
    blocks = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2, GROUP // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def q8_sums() -> bool:
    """Whether this machine's kernels read an 8-bit block's code sums (kernels.h's ``Q8_BYTES``): the AVX-512
    build's products take them back off. The AVX2 and AVX-VNNI builds never read them, and without them an 8-bit
    LM head's product streams 11% fewer bytes: 0.89x the time at 1 and 2 tokens on a 2-core AVX2 EPYC (the
    embedded target's 49,152 x 576 head, 2026-11-29)."""
    try:
        return kernels.isa() == "avx512-vnni"
    except StopIteration:  # (no instruction set the kernels know: no kernel reads them)
        return False


def packing() -> str:
    """What packed bytes this machine's kernels read, for bytes kept on disk (``files.made_once``'s ``form``)."""
    return f"q8 {'with' if q8_sums() else 'without'} sums"


def pack_eight(codes: Tensor, scales: Tensor, sums: bool | None = None) -> Tensor:
    """Q8 codes [N, K] (-128..127) and float16 scales [N, K/32] -> the kernel's bytes [N/16, K/32, 544] (608 with
    ``sums``; default: ``q8_sums()``): per group of 16 rows and block, for j = 0..7, 64 bytes holding row i's
    codes 4j..4j+3 (byte 4i + c), then the 16 scales, then, with ``sums``, the 16 rows' code sums (int32)."""
    blocks = _grouped(codes.to(torch.int8).reshape(codes.shape[0], -1, 8, 4))  # [G, 16, b, j, c]
    interleaved = blocks.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8)
    parts = [interleaved.reshape(*interleaved.shape[:2], -1), _per_block(scales.to(torch.float16))]
    if q8_sums() if sums is None else sums:
        parts.append(_per_block(codes.to(torch.int32).reshape(codes.shape[0], -1, GROUP).sum(-1, dtype=torch.int32)))
    return torch.cat(parts, -1).contiguous()


def _unpack_codes(packed: Tensor, rows: int, per_chunk: int) -> Tensor:
    """The codes bytes of ``packed`` [G, b, bytes] back to [rows, b, per_chunk, 4] (row-major, unpadded)."""
    codes = packed[:, :, : per_chunk * 64].reshape(packed.shape[0], packed.shape[1], per_chunk, ROWS, 4)
    return codes.permute(0, 3, 1, 2, 4).reshape(-1, packed.shape[1], per_chunk, 4)[:rows]


def _unpack_values(packed: Tensor, rows: int, start: int, dtype: torch.dtype) -> Tensor:
    """[rows, b] values of ``dtype`` stored per block at byte ``start`` of ``packed`` [G, b, bytes]."""
    size = ROWS * torch.empty((), dtype=dtype).element_size()
    values = packed[:, :, start: start + size].contiguous().view(dtype)  # [G, b, 16]
    return values.transpose(1, 2).reshape(-1, packed.shape[1])[:rows]


class Int4Linear(nn.Module):
    """y = x @ W.T (no bias) for W held as Q4 blocks, W[n, k] = q[n, k] * scale[n, k // 32] + minimum[n, k // 32].
    Made from GGUF's own bytes: ``nibbles`` uint8 [N, K/2] (per block of 32 inputs, element j in the low nibble
    of byte j and element j + 16 in the high one), ``scales`` and ``minimums`` float16 [N, K/32]; held packed
    for the kernel (``packed``, [ceil(N/16), K/32, 320] bytes)."""

    def __init__(self, nibbles: Tensor, scales: Tensor, minimums: Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = nibbles.shape[0], nibbles.shape[1] * 2
        if self.in_features % GROUP or scales.shape != (self.out_features, self.in_features // GROUP) \
                or minimums.shape != scales.shape:
            raise ValueError(f"an int4 weight needs inputs in blocks of {GROUP}, with one scale and minimum a block; "
                             f"got codes {tuple(nibbles.shape)}, scales {tuple(scales.shape)}")
        self.register_buffer("packed", pack_four(nibbles, scales, minimums))

    @classmethod
    def packed_as(cls, packed: Tensor, out_features: int, in_features: int) -> "Int4Linear":
        """A layer on bytes already packed (``pack_four``)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.register_buffer("packed", packed)
        layer.out_features, layer.in_features = out_features, in_features
        return layer

    @classmethod
    def from_codes(cls, codes: Tensor, scales: Tensor, minimums: Tensor) -> "Int4Linear":
        """``codes`` [N, K] (0..15); ``scales`` and ``minimums`` [N, K/32]."""
        if codes.shape[1] % GROUP:
            raise ValueError(f"an int4 weight needs inputs in blocks of {GROUP}, got {tuple(codes.shape)}")
        return cls(nibbles_of(codes), scales, minimums)

    @classmethod
    def rounded(cls, weight: Tensor, rows: Tensor | None = None) -> "Int4Linear":
        """A float weight [N, K] (``rows``: its rows of these indices) rounded to Q4_1 as llama.cpp rounds it: per
        block of 32 inputs, minimum = the block's least weight and scale = its range / 15 (both float16),
        q = round((w - minimum) / scale). Done ``ROUNDING_ROWS`` rows at a time, which stay in the CPU's caches
        through the few passes it makes over them: a drafter's 16,384 LM head rows (rounded at every load) took
        55 ms so on a 2-core EPYC, against 90-106 ms in whole passes over their 38 MB, and 39 ms with each block's
        least and greatest found by two reductions, not one (``aminmax`` over 32 values ran 4x slower)."""
        weight = weight.detach()
        count = weight.shape[0] if rows is None else rows.shape[0]
        packed = []
        for start in range(0, count, ROUNDING_ROWS):
            part = weight[start: start + ROUNDING_ROWS] if rows is None else \
                weight.index_select(0, rows[start: start + ROUNDING_ROWS])
            blocks = part.float().reshape(part.shape[0], -1, GROUP)
            low, high = blocks.amin(-1), blocks.amax(-1)
            minimums = low.half()
            scales = ((high - minimums.float()) / 15).half()
            inverse = torch.where(scales > 0, 1 / scales.float(), torch.zeros_like(scales, dtype=torch.float32))
            # (in place, and packed straight from the codes)
            codes = blocks.sub(minimums.float()[..., None]).mul_(inverse[..., None]).round_().clamp_(0, 15)
            packed.append(pack_four(nibbles_of(codes.reshape(part.shape)), scales, minimums))
        return cls.packed_as(torch.cat(packed) if len(packed) != 1 else packed[0], count, weight.shape[1])

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.fuzzyspec_int4.mm_q4(x, self.packed)
        return y if y.shape[-1] == self.out_features else y[..., : self.out_features]

    def codes(self) -> Tensor:
        """The 4-bit codes [N, K] (int32)."""
        nibbles = _unpack_codes(self.packed, self.out_features, 4).int()  # [N, b, j, c]: codes 4j+c | 16+4j+c
        return torch.stack([nibbles & 0x0F, nibbles >> 4], 2).reshape(self.out_features, self.in_features)

    def scales(self) -> Tensor:
        return _unpack_values(self.packed, self.out_features, 256, torch.float16)

    def minimums(self) -> Tensor:
        return _unpack_values(self.packed, self.out_features, 288, torch.float16)

    def weight(self) -> Tensor:
        """The float32 weight [N, K] (for checks: a float copy of the weight)."""
        return dequantize(self.codes(), self.scales(), self.minimums())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}"


def fuse(linears: list[Int4Linear]) -> Int4Linear:
    """One layer computing every one of ``linears`` (same inputs) at once, their outputs side by side: one kernel
    call where there were several (q, k and v; gate and up), which saves the per-call cost of each. The layers
    keep working alone (transformers' own forward calls them), on views of the fused layer's groups of rows:
    the codes are held once. Each layer's rows must fill whole groups of 16."""
    if any(linear.out_features % ROWS for linear in linears):
        raise ValueError(f"fusing int4 layers needs whole groups of {ROWS} rows")
    fused = Int4Linear.packed_as(torch.cat([linear.packed for linear in linears]),
                                 sum(linear.out_features for linear in linears), linears[0].in_features)
    start = 0
    for linear in linears:
        groups = linear.out_features // ROWS
        linear.packed = fused.packed[start: start + groups]
        start += groups
    return fused


def fuse_projections(model: nn.Module) -> None:
    """Give every decoder layer of a Llama-family ``model`` whose q, k and v (gate and up) are all int4 one fused
    layer for them, ``self_attn.qkv_proj`` (``mlp.gate_up_proj``), which our step (``core.step``) calls instead.
    Layers whose rows do not fill whole groups of 16 stay apart."""
    for owner, name, linears in projection_groups(model):
        if all(isinstance(m, Int4Linear) and m.out_features % ROWS == 0 for m in linears):
            setattr(owner, name, fuse(linears))


def projection_groups(model: nn.Module) -> Iterator[tuple[nn.Module, str, list[nn.Module | None]]]:
    """The projections of each decoder layer of a Llama-family ``model`` that read the same input, as (the module
    holding them, the name of their fused layer, the layers): q, k and v (``self_attn.qkv_proj``); gate and up
    (``mlp.gate_up_proj``)."""
    for layer in model.get_decoder().layers:
        for owner, name, parts in ((layer.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                   (layer.mlp, "gate_up_proj", ("gate_proj", "up_proj"))):
            yield owner, name, [getattr(owner, part, None) for part in parts]


class Int8Linear(nn.Module):
    """y = x @ W.T (no bias) for W = q[n, k] * scales[n, k // 32], llama.cpp's Q8_0 at its own bytes (int8 codes
    [N, K] and float16 scales [N, K/32]), held packed for the kernel (``packed``, [ceil(N/16), K/32, 544 or 608]
    bytes: ``pack_eight``).
    ``weight`` is the float W (a tied model's embedding, which lookups read anyway): checks compare with it."""

    def __init__(self, codes: Tensor, scales: Tensor, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("packed", pack_eight(codes, scales))
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def rounded(cls, linear: nn.Linear) -> "Int8Linear":
        """A float layer rounded to Q8_0 as llama.cpp rounds it: per block of 32 inputs, scale = max|w| / 127 (in
        float16) and q = round(w / scale). Its products move by about 0.5% of a block's largest weight."""
        weight = linear.weight.detach().float()
        blocks = weight.reshape(weight.shape[0], -1, GROUP)
        scales = (blocks.abs().amax(-1) / 127).half()
        inverse = torch.where(scales > 0, 1 / scales.float(), torch.zeros_like(scales, dtype=torch.float32))
        codes = (blocks * inverse[..., None]).round().clamp(-127, 127).to(torch.int32).reshape(weight.shape)
        return cls(codes, scales, linear.weight.detach(), linear.bias)

    @classmethod
    def packed_as(cls, packed: Tensor, linear: nn.Linear) -> "Int8Linear":
        """The layer ``rounded(linear)`` makes, on its bytes made earlier (``packed``)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = linear.out_features, linear.in_features
        layer.register_buffer("packed", packed)
        layer.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        layer.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        return layer

    @classmethod
    def from_codes(cls, codes: Tensor, scales: Tensor, weight: Tensor | None = None) -> "Int8Linear":
        """``codes`` [N, K] in -128..127, ``scales`` [N, K/32]; ``weight``: the float W if the caller has it."""
        if weight is None:
            weight = dequantize(codes, scales.to(torch.float16))
        return cls(codes, scales, weight)

    def codes(self) -> Tensor:
        """The int8 codes [N, K]."""
        return _unpack_codes(self.packed, self.out_features, 8).view(torch.int8).reshape(self.out_features, -1)

    def scales(self) -> Tensor:
        return _unpack_values(self.packed, self.out_features, 512, torch.float16)

    def rows(self, index: Tensor) -> "Int8Linear":
        """The layer of W's rows ``index`` (a drafter's reduced vocabulary), in the same form."""
        return Int8Linear(self.codes().index_select(0, index), self.scales().index_select(0, index),
                          self.weight.detach().index_select(0, index))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.fuzzyspec_int4.mm_q8(x, self.packed)
        y = y if y.shape[-1] == self.out_features else y[..., : self.out_features]
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}, 8-bit"
                f"{', bias' if self.bias is not None else ''}")


def holds_blocks(model: nn.Module) -> bool:
    """Whether ``model`` holds layers of llama.cpp's blocks (a target at its GGUF's own bytes, or a drafter
    rounded to match it)."""
    return any(isinstance(module, (Int4Linear, Int8Linear)) for module in model.modules())


def roundable(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The float ``nn.Linear`` layers in ``module`` (by name) whose inputs fill blocks of 32: those ``round_linears``
    rounds."""
    return [(name, child) for name, child in module.named_modules()
            if type(child) is nn.Linear and child.in_features % GROUP == 0]


def round_linears(module: nn.Module, packed: dict[str, Tensor] | None = None) -> None:
    """Replace every ``roundable`` layer in ``module`` by its Q8_0 rounding (``Int8Linear.rounded``): a small drafter
    of a 4-bit target then reads a quarter of its float32 bytes, through the same kernel (its layers' float products
    took most of a draft step beside a 4-bit target's). ``packed``: each layer's bytes by name, as made earlier
    (kept on disk, ``files.made_once``)."""
    for name, linear in roundable(module):
        module.set_submodule(name, Int8Linear.rounded(linear) if packed is None else
                             Int8Linear.packed_as(packed[name], linear))
