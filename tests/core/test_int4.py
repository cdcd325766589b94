"""Int4 linear layers: the kernel's formula, and a model holding them decodes as its own target."""
import pytest
import torch

from conftest import tiny_llama
from fuzzyspec.core import int4
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.engine import decode
from fuzzyspec.core.int4 import GROUP, Int4Linear, Int8Linear
from fuzzyspec.core.step import TargetStep
from fuzzyspec.drafters.model import ModelDrafter

pytestmark = pytest.mark.skipif(not int4.available(), reason="this torch build has no CPU int4 kernel")


def quantize(weight: torch.Tensor) -> Int4Linear:
    """Round a float weight to the int4 grid (per group of 32 inputs: a scale and an offset), as Q4_1 does."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp_min(1e-8)
    codes = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.int32)
    return Int4Linear.from_codes(codes.reshape(out_features, in_features), scales, low + 8 * scales)


def test_the_layer_computes_with_its_codes_scales_and_offsets():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 64), generator=generator, dtype=torch.int32)
    scales = torch.rand(48, 2, generator=generator) * 0.1 + 0.01
    offsets = torch.randn(48, 2, generator=generator) * 0.1
    layer = Int4Linear.from_codes(codes, scales, offsets)
    expected = (codes.float() - 8) * scales.repeat_interleave(GROUP, 1) + offsets.repeat_interleave(GROUP, 1)
    torch.testing.assert_close(layer.weight(), expected, rtol=0, atol=2 ** -7 * expected.abs().max().item())
    x = torch.randn(5, 64, generator=generator)
    torch.testing.assert_close(layer(x), x @ layer.weight().T, rtol=2e-2, atol=2e-2)
    assert layer(x).dtype == torch.float32 and (layer.in_features, layer.out_features) == (64, 48)
    with pytest.raises(ValueError, match="groups of 32"):
        Int4Linear.from_codes(codes[:, :40], scales, offsets)


def test_an_8_bit_layer_is_its_codes_times_its_scales_and_its_rows_keep_them():
    """Q8_0's codes (-128..127) as two int4 halves: the product is x @ (scale * q).T, and a reduced vocabulary's
    rows (``rows``) are the same codes and scales, recovered from the float weight exactly."""
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(-128, 128, (64, 96), generator=generator, dtype=torch.int32)
    codes[0] = torch.tensor([-128, 127, 0] * 32)  # the extremes of both halves
    scales = torch.rand(64, 3, generator=generator) * 0.01
    scales[5, 1] = 0.0  # an all-zero group
    layer = Int8Linear.from_codes(codes, scales)
    weight = codes.float() * scales.repeat_interleave(GROUP, 1)
    assert torch.equal(layer.weight, weight)
    x = torch.randn(4, 96, generator=generator).to(torch.bfloat16).float()  # exact in the kernel's bfloat16
    scale = x.abs().sum(-1, keepdim=True) * weight.abs().max()
    torch.testing.assert_close(layer(x), x @ weight.T, rtol=0, atol=(2 ** -7 * scale).max().item())
    index = torch.tensor([5, 0, 17, 63, 2, 9, 11, 30, 31, 40, 41, 42, 43, 44, 45, 46])
    rows = layer.rows(index)
    assert torch.equal(rows.weight, weight[index]) and torch.equal(rows.scales, scales[index])
    torch.testing.assert_close(rows(x), layer(x)[:, index], rtol=0, atol=1e-5)


def int4_model(seed: int, fused: bool = False) -> torch.nn.Module:
    model = tiny_llama(seed=seed)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, quantize(child.weight.data))
    if fused:
        int4.fuse_projections(model)
    return model


def test_fused_projections_compute_each_layers_outputs_side_by_side():
    model = int4_model(seed=1, fused=True)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = torch.randn(4, 32)
    assert torch.equal(attention.qkv_proj(x), torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], -1))
    assert torch.equal(mlp.gate_up_proj(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1))
    # where the sizes respect the packing's row blocks (gate and up: 64 rows each), the separate layers read the
    # fused codes: one copy in memory; k and v (16 rows each here) do not, and are packed anew
    assert mlp.up_proj.packed.untyped_storage().data_ptr() == mlp.gate_up_proj.packed.untyped_storage().data_ptr()
    assert torch.equal(mlp.up_proj(x), mlp.gate_up_proj(x)[:, 64:])
    assert torch.equal(attention.v_proj(x), attention.qkv_proj(x)[:, 48:])


@pytest.mark.parametrize("compile,fused", [(False, False), (False, True), (True, True)])
def test_an_int4_target_decodes_losslessly_through_our_step(draft, compile, fused):
    """sd reproduces the int4 target exactly: the engine's own forward (eager or compiled, with the projections
    fused or not) gives the greedy text of transformers' generate on the same int4 model."""
    model = int4_model(seed=0, fused=fused)
    prompt = torch.tensor([[1, 5, 9, 3, 7, 2]])
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False)[0, 6:].tolist()
    step = TargetStep(model, compile=compile)
    for method in ("ar", "sd"):
        tokens, stats = decode(step, ModelDrafter(draft, 32), prompt, DecodeConfig(method=method, max_new_tokens=20), 32)
        assert tokens[0].tolist() == expected
