"""A GGUF at its own 4-bit bytes: the block formats, and the embedded target's weights against transformers'."""
import numpy as np
import pytest
import torch

from fuzzyspec import gguf
from fuzzyspec.core import int4, kernels

needs_kernel = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable()}")


def blocks(kind: str, rows: int, groups: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random raw rows of Q4_0 or Q4_1 blocks, and the weights they stand for (llama.cpp's formulas)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (rows, groups, 32))
    d = rng.uniform(0.01, 0.1, (rows, groups)).astype(np.float16)
    m = rng.uniform(-0.5, 0.5, (rows, groups)).astype(np.float16)
    packed = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)  # element j low, j + 16 high
    head = [d.view(np.uint8).reshape(rows, groups, 2)] + ([m.view(np.uint8).reshape(rows, groups, 2)]
                                                          if kind == "Q4_1" else [])
    raw = np.concatenate(head + [packed], -1).reshape(rows, -1)
    d32, m32 = d.astype(np.float32)[..., None], m.astype(np.float32)[..., None]
    weights = d32 * codes + m32 if kind == "Q4_1" else d32 * (codes - 8)
    return raw, weights.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_four_bit_blocks_decode_to_llama_cpps_weights(kind):
    raw, weights = blocks(kind, 16, 3)
    assert np.array_equal(gguf._decode(raw, kind), weights)  # as llama.cpp computes them, exactly
    nibbles, scales, minimums = gguf.four_bit(raw, kind)
    assert nibbles.dtype == np.uint8 and scales.dtype == minimums.dtype == np.float16
    order = gguf.rope_rows(16, 2)
    reordered, _, _ = gguf.four_bit(raw, kind, order)
    assert np.array_equal(reordered, nibbles[order])  # whole rows move; codes stay the file's


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_the_kernel_multiplies_by_the_files_weights(kind):
    raw, weights = blocks(kind, 32, 2, seed=1)
    layer = int4.Int4Linear(*map(torch.from_numpy, gguf.four_bit(raw, kind)))
    assert torch.equal(layer.weight(), torch.from_numpy(weights))


def test_rope_rows_undo_the_interleaving_of_each_heads_halves():
    order = gguf.rope_rows(8, 2)  # 2 heads of 4 rows: the file holds each head's rows as pairs (0, 2), (1, 3)
    assert order.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.embedded
@needs_kernel
def test_the_embedded_target_holds_its_own_4bit_weights():
    """Every decoder linear is the GGUF's blocks and equals the float32 weight transformers dequantizes from
    the same file; norms and the embedding are bit-identical; the LM head is the
    embedding's Q8_0 codes."""
    from safetensors.torch import load_file

    from fuzzyspec.loading import embedded_folder, embedded_gguf

    model = gguf.load_int4(embedded_gguf())
    reference = load_file(str(embedded_folder() / "model.safetensors"))
    linears = 0
    for i, layer in enumerate(model.model.layers):
        for name, module in layer.named_modules():
            assert not isinstance(module, torch.nn.Linear), f"a float linear is left in layer {i}: {name}"
            if isinstance(module, int4.Int4Linear) and name not in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
                linears += 1
                expected = reference[f"model.layers.{i}.{name}.weight"]
                torch.testing.assert_close(module.weight(), expected, rtol=0, atol=1e-6 * expected.abs().max().item())
    assert linears == 7 * model.config.num_hidden_layers
    # q, k and v (and gate and up) also run as one product, over the same codes (no second copy)
    attention, mlp = model.model.layers[3].self_attn, model.model.layers[3].mlp
    assert attention.k_proj.packed.untyped_storage().data_ptr() == attention.qkv_proj.packed.untyped_storage().data_ptr()
    x = torch.randn(3, model.config.hidden_size)
    assert torch.equal(attention.qkv_proj(x), torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], -1))
    assert torch.equal(mlp.gate_up_proj(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1))
    assert torch.equal(model.model.embed_tokens.weight, reference["model.embed_tokens.weight"])
    assert torch.equal(model.model.norm.weight, reference["model.norm.weight"])
    # the tied Q8_0 head is read at its own 8-bit codes, its float rows being the embedding's
    assert isinstance(model.lm_head, int4.Int8Linear) and model.lm_head.weight is model.model.embed_tokens.weight
    codes = model.lm_head.codes().float() * model.lm_head.scales().float().repeat_interleave(int4.GROUP, 1)
    assert torch.equal(codes, reference["model.embed_tokens.weight"])


@pytest.mark.embedded
@needs_kernel
def test_the_kept_target_and_head_bytes_are_what_loading_makes(tmp_path, monkeypatch):
    """A 4-bit target made once and read back (``files.made_once``) is the model ``load_int4`` builds, to the bit,
    with its tie and fused views; the shipped EAGLE head's bytes beside it, kept, are those made fresh."""
    from fuzzyspec import files
    from fuzzyspec.drafters import registry
    from fuzzyspec.drafters.registry import load_drafter
    from fuzzyspec.loading import _load_int4, embedded_gguf

    monkeypatch.setattr(files, "cache_dir", lambda: tmp_path)
    built = gguf.load_int4(embedded_gguf())
    made, _ = _load_int4(None)
    kept, tokenizer = _load_int4(None)
    assert len(list((tmp_path / "made").glob("int4-*.pt"))) == 1
    assert kept.gguf_file == embedded_gguf().resolve()
    expected = built.state_dict()
    for name, tensor in kept.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert kept.lm_head.weight is kept.model.embed_tokens.weight
    attention = kept.model.layers[5].self_attn
    assert attention.v_proj.packed.untyped_storage().data_ptr() == attention.qkv_proj.packed.untyped_storage().data_ptr()
    tokens = torch.tensor([[1, 504, 3458, 28, 2]])
    assert torch.equal(kept(tokens).logits, built(tokens).logits)

    fresh = load_drafter("eagle", built, tokenizer)  # (no GGUF named on the target: made, not kept)
    assert not list((tmp_path / "made").glob("head-*.pt"))
    load_drafter("eagle", made, tokenizer)
    head = load_drafter("eagle", kept, tokenizer)
    assert len(list((tmp_path / "made").glob("head-*.pt"))) == 1
    expected = fresh.module.state_dict()
    assert head.module.state_dict().keys() == expected.keys()
    for name, tensor in head.module.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    drafts = [source.new(built.config.vocab_size) for source in (fresh, head)]
    features = torch.randn(1, 4, built.config.hidden_size)
    assert torch.equal(*(drafter._head_logits(features) for drafter in drafts))

    # both are kept under the packing this machine's kernels read: a cache shared with a machine whose kernels read
    # the other (an 8-bit block with or without its code sums) keeps each one's own
    forms, keep = [], registry.made_once
    monkeypatch.setattr(registry, "made_once", lambda *args, **kwargs: forms.append(kwargs.get("form")) or
                        keep(*args, **kwargs))
    load_drafter("eagle", kept, tokenizer)
    assert forms == [int4.packing()]
    other = not int4.q8_sums()
    monkeypatch.setattr(int4, "q8_sums", lambda: other)
    _load_int4(None)
    assert len(list((tmp_path / "made").glob("int4-*.pt"))) == 2
