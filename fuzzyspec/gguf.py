"""A llama.cpp GGUF file as a target at its own 4-bit bytes: no float copy of a quantized weight is made.

``load_int4`` builds a Llama LM of our own modules (``core.llama``, laid out as transformers' ``LlamaForCausalLM``)
on the meta device and fills it from the file:
every decoder linear stored in Q4_0 or Q4_1 becomes a ``core.int4.Int4Linear`` holding the file's own
blocks (codes, float16 scales and minimums, exactly as stored); norms, the token embedding and any tensor
in another format are dequantized to float32, exactly (Q8_0's d * q is exact in float32). An LM head stored
in Q8_0 (a tied one is the embedding) becomes a ``core.int4.Int8Linear`` on its own 8-bit codes, keeping
the float rows for lookups and drafters.

Formats (ggml's blocks of 32 along the input dimension; in a 4-bit block element j is the low nibble of
byte j and element j + 16 its high nibble):

- Q4_0: 18 bytes: float16 d, 16 bytes of codes; w = d * (q - 8)  -> scale d, minimum -8 d (exact);
- Q4_1: 20 bytes: float16 d, float16 m, 16 bytes of codes; w = d * q + m  -> scale d, minimum m;
- Q8_0: 34 bytes: float16 d, 32 int8; w = d * q.

llama.cpp's converter reorders the rows of the query and key projections (the two halves of each head's
rotary dimensions interleaved); transformers' GGUF loader undoes it, and so does ``rope_rows`` here.
Quantization groups run along the input dimension, so whole rows move and the codes stay the file's.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .core.int4 import GROUP, Int4Linear, Int8Linear, dequantize, fuse_projections, nibble_codes
from .core.llama import LlamaLikeConfig, LlamaLM, Rotary

TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34)}
FOUR_BIT = {"Q4_0": 2, "Q4_1": 4}  # where a block's codes start
BLOCK_BYTES = {name: size for name, _, size in TYPES.values()}
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}
_LENGTH = struct.Struct("<Q")  # a string's byte count
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class Tensor4:
    """One stored tensor: its format, its shape in PyTorch order ([out, in] for a linear) and its raw rows."""

    def __init__(self, name: str, kind: str, shape: tuple[int, ...], raw: np.ndarray) -> None:
        self.name, self.kind, self.shape, self.raw = name, kind, shape, raw


class GGUFFile:
    """The metadata and tensors of a GGUF (v2 or v3) file, memory-mapped: nothing is read until used.
    Long metadata arrays (the tokenizer's 49k strings) are skipped, their length kept, but for the keys named in
    ``arrays``: read whole, strings as a list, numbers as a numpy array."""

    def __init__(self, path: str | Path, arrays: tuple[str, ...] = ()) -> None:
        self.path = str(path)
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._view, self._at = memoryview(data), 0
        if self._bytes(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, tensors, entries = self._unpack("<IQQ")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        self.metadata = {}
        for _ in range(entries):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I")[0], whole=key in arrays)
        infos = []
        for _ in range(tensors):
            name = self._string()
            dims = self._unpack(f"<{self._unpack('<I')[0]}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, dims, kind, offset))
        align = int(self.metadata.get("general.alignment", 32))
        base = -(-self._at // align) * align
        self.tensors: dict[str, Tensor4] = {}
        for name, dims, kind, offset in infos:
            if kind not in TYPES:
                self.tensors[name] = Tensor4(name, f"ggml type {kind}", tuple(reversed(dims)), data[:0])
                continue
            type_name, per_block, block_bytes = TYPES[kind]
            rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            row_bytes = dims[0] // per_block * block_bytes
            raw = data[base + offset: base + offset + rows * row_bytes].reshape(rows, row_bytes)
            self.tensors[name] = Tensor4(name, type_name, tuple(int(d) for d in reversed(dims)), raw)
        del self._view

    def _bytes(self, n: int) -> bytes:
        out = bytes(self._view[self._at: self._at + n])
        self._at += n
        return out

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._view, self._at)
        self._at += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        return self._bytes(self._unpack("<Q")[0]).decode("utf-8", errors="replace")

    def _value(self, kind: int, whole: bool = False):
        if kind == 8:
            return self._string()
        if kind == 9:
            item, count = self._unpack("<IQ")
            if count <= 64:
                return [self._value(item) for _ in range(count)]
            if whole and item == 8:
                return self._strings(count)
            # skipped (the tokenizer's vocabulary, merges, ...) unless asked for
            if item == 9:
                raise ValueError(f"{self.path}: nested metadata arrays are not supported")
            if whole:
                numbers = np.frombuffer(self._view, dtype=np.dtype(_SCALARS[item]), count=count, offset=self._at)
                self._at += numbers.nbytes
                return numbers.copy()
            if item != 8:
                self._at += count * struct.calcsize(_SCALARS[item])
                return count
            # A string is its length and its bytes: each length says where the next begins. Through ``_unpack`` the
            # embedded model's 98,000 strings took 35 ms of every load; read with the loop's own names, 16 ms.
            view, at, length = self._view, self._at, _LENGTH.unpack_from
            for _ in range(count):
                at += 8 + length(view, at)[0]
            self._at = at
            return count
        return self._unpack(_SCALARS[kind])[0]

    def _strings(self, count: int) -> list[str]:
        """The next ``count`` strings (the loop's own names: through ``_string`` 98,000 took 0.15 s)."""
        view, at, length, out = self._view, self._at, _LENGTH.unpack_from, []
        for _ in range(count):
            size = length(view, at)[0]
            out.append(str(view[at + 8: at + 8 + size], "utf-8", "replace"))
            at += 8 + size
        self._at = at
        return out

    def floats(self, name: str, rows: np.ndarray | None = None) -> torch.Tensor:
        """A tensor dequantized to float32, a few thousand rows at a time straight into the result."""
        tensor = self.tensors[name]
        if tensor.kind not in BLOCK_BYTES:
            raise ValueError(f"{self.path}: {name} is stored as {tensor.kind}, which this reader does not decode")
        raw = tensor.raw if rows is None else tensor.raw[rows]
        out = torch.empty(tensor.shape, dtype=torch.float32)
        flat = out.view(raw.shape[0], -1)
        for start in range(0, raw.shape[0], 4096):
            flat[start: start + 4096] = torch.from_numpy(_decode(raw[start: start + 4096], tensor.kind))
        return out


def _decode(raw: np.ndarray, kind: str) -> np.ndarray:
    """float32 [rows, cols] from rows of F32, F16, Q8_0, Q4_0 or Q4_1 blocks."""
    if kind == "F32":
        return raw.view(np.float32).copy()
    if kind == "F16":
        return raw.view(np.float16).astype(np.float32)
    if kind == "Q8_0":
        codes, scales = eight_bit(raw)
        return codes.astype(np.float32) * np.repeat(scales.astype(np.float32), GROUP, 1)
    # the layer's own float weight: one place knows the nibble layout and computes code * scale + minimum
    nibbles, scales, minimums = (torch.from_numpy(np.ascontiguousarray(part)) for part in four_bit(raw, kind))
    return dequantize(nibble_codes(nibbles), scales, minimums).numpy()


def eight_bit(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 rows -> codes int8 [N, K] and float16 scales [N, K/32]: w = code * scale."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    return blocks[..., 2:].view(np.int8).reshape(raw.shape[0], -1), blocks[..., :2].copy().view(np.float16)[..., 0]


def four_bit(raw: np.ndarray, kind: str, rows: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 or Q4_1 rows -> their codes as stored, uint8 [N, K/2] (two a byte, see above), and float16 scales
    and minimums [N, K/32], such that w = code * scale + minimum. ``rows``: an order for whole rows."""
    blocks = raw.reshape(raw.shape[0], -1, BLOCK_BYTES[kind])
    if rows is not None:
        blocks = blocks[rows]
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q4_1":
        minimums = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    else:  # Q4_0: w = d (q - 8); times 8 is exact in float16
        minimums = scales * np.float16(-8)
    return blocks[..., FOUR_BIT[kind]:].reshape(blocks.shape[0], -1), scales, minimums


def rope_rows(count: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's reordering of a query or key projection: row r of the
    Hugging Face weight is row order[r] of the file's."""
    half = count // heads // 2
    return np.arange(count).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)


def llama_config(gguf: GGUFFile) -> LlamaLikeConfig:
    """The Llama config a GGUF file's metadata describes (the llama architecture only)."""
    meta = gguf.metadata
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"int4 weights are implemented for llama GGUFs; {gguf.path} is "
                         f"{meta.get('general.architecture')!r}: load it with --weights fp32")

    def get(key: str, default=None):
        return meta.get(f"llama.{key}", default)

    heads, hidden = get("attention.head_count"), get("embedding_length")
    return LlamaLikeConfig(
        vocab_size=gguf.tensors["token_embd.weight"].shape[0], hidden_size=hidden,
        intermediate_size=get("feed_forward_length"), num_hidden_layers=get("block_count"),
        num_attention_heads=heads, num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=get("rope.dimension_count", hidden // heads), max_position_embeddings=get("context_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_theta": get("rope.freq_base", 10000.0), "rope_type": "default"},
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"), dtype=torch.float32)


def int4_linears(gguf: GGUFFile) -> int:
    """How many of the decoder's linear layers the file stores in a 4-bit format the int4 kernel takes."""
    return sum(tensor.kind in FOUR_BIT for name, tensor in gguf.tensors.items()
               if name.startswith("blk.") and name.split(".")[2] in LINEARS)


def load_int4(path: str | Path) -> nn.Module:
    """A Llama LM (``core.llama``) whose decoder linears run on the file's own 4-bit blocks (see the module
    docstring)."""
    gguf = GGUFFile(path)
    config = llama_config(gguf)
    if not int4_linears(gguf):
        raise ValueError(f"{path} stores no decoder weight as Q4_0 or Q4_1, the int4 kernel's blocks (Q4_K and others "
                         "are not implemented): load it with --weights fp32")
    with torch.device("meta"):
        model = LlamaLM(config)
    frozen = lambda tensor: nn.Parameter(tensor, requires_grad=False)  # noqa: E731
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for i, layer in enumerate(model.model.layers):
        for short, where in LINEARS.items():
            tensor = gguf.tensors[f"blk.{i}.{short}.weight"]
            rows = rope_rows(tensor.shape[0], heads[short]) if short in heads else None
            if tensor.kind in FOUR_BIT:
                module = Int4Linear(*(torch.from_numpy(np.ascontiguousarray(part))
                                      for part in four_bit(tensor.raw, tensor.kind, rows)))
            else:
                module = nn.Linear(tensor.shape[1], tensor.shape[0], bias=False, device="meta")
                module.weight = frozen(gguf.floats(tensor.name, rows))
            parent, name = where.split(".")
            setattr(getattr(layer, parent), name, module)
        layer.input_layernorm.weight = frozen(gguf.floats(f"blk.{i}.attn_norm.weight"))
        layer.post_attention_layernorm.weight = frozen(gguf.floats(f"blk.{i}.ffn_norm.weight"))
    model.model.norm.weight = frozen(gguf.floats("output_norm.weight"))
    model.model.embed_tokens.weight = frozen(gguf.floats("token_embd.weight"))
    head = gguf.tensors["token_embd.weight" if config.tie_word_embeddings else "output.weight"]
    weight = model.model.embed_tokens.weight if config.tie_word_embeddings else frozen(gguf.floats(head.name))
    if head.kind == "Q8_0":  # read at its own 8.5 bits a weight, not float32's 32
        codes, scales = eight_bit(head.raw)
        model.lm_head = Int8Linear(torch.from_numpy(codes.copy()), torch.from_numpy(scales), weight)
    else:
        model.lm_head.weight = weight
    model.model.rotary_emb = Rotary(config)  # its buffers were made on meta
    fuse_projections(model)
    left = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if left:
        raise ValueError(f"{path}: no weights for {', '.join(left[:3])}")
    return model.eval()
