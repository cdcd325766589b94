"""The target's forward over the static cache, ours and transformers', eager and compiled, equals plain forwards."""
import pytest
import torch

from conftest import run_step as run, tiny_llama
from fuzzyspec.core import kernels, step as step_module
from fuzzyspec.core.kvcache import StaticCache, chain_tree
from fuzzyspec.core.hf_forward import HFForward
from fuzzyspec.core.llama import rotate
from fuzzyspec.core.step import LlamaForward, TargetStep, fuse_float_projections, rms_norm


def plain(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens]), output_hidden_states=True)


@pytest.mark.parametrize("own", [True, False])
def test_rows_of_different_lengths_and_rejected_positions_equal_plain_forwards(target, own):
    step = TargetStep(target, own=own)
    assert isinstance(step.forward, LlamaForward if own else HFForward)
    cache = StaticCache.for_model(target.config, 2, 32, torch.float32, "cpu")
    with torch.inference_mode():
        cache.lengths = [0, 0]
        run(step, cache, [[3, 9, 4, 4, 8], [7, 1, 2, 5, 6]])
        cache.lengths = [3, 5]  # row 0 keeps 3, 9, 4: its last two positions are rejected, to be overwritten
        logits, found = run(step, cache, [[6, 11], [13, 14]], features=(0, 1, 2))
    for row, tokens in enumerate([[3, 9, 4, 6, 11], [7, 1, 2, 5, 6, 13, 14]]):
        expected = plain(target, tokens)
        torch.testing.assert_close(logits[row], expected.logits[0, -2:], rtol=1e-4, atol=1e-4)
        for layer in (0, 1, 2):  # the inputs of layers 0 and 1, and the final normed output
            torch.testing.assert_close(found[layer][row], expected.hidden_states[layer][0, -2:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("own", [True, False])
def test_a_tree_pass_and_keeping_a_path_equal_plain_forwards(target, own):
    step = TargetStep(target, own=own)
    cache = StaticCache.for_model(target.config, 1, 16, torch.float32, "cpu")
    with torch.inference_mode():
        run(step, cache, [[3, 9, 4]])
        cache.lengths = [3]
        # newest token 6, then the tree: 11 and 12 below it, 13 below 11, 14 below 13
        tree = torch.tensor([[[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]],
                            dtype=torch.bool)
        logits, _ = run(step, cache, [[6, 11, 12, 13, 14]], tree, torch.tensor([[0, 1, 1, 2, 3]]))
        for column, path in [(2, [6, 12]), (4, [6, 11, 13, 14])]:
            torch.testing.assert_close(logits[0, column], plain(target, [3, 9, 4] + path).logits[0, -1],
                                       rtol=1e-4, atol=1e-4)
        cache.keep(0, 3, [0, 1, 3])  # keep 6, 11, 13
        cache.lengths = [6]
        after, _ = run(step, cache, [[20]])
    torch.testing.assert_close(after[0, -1], plain(target, [3, 9, 4, 6, 11, 13, 20]).logits[0, -1],
                               rtol=1e-4, atol=1e-4)


def test_fused_float_projections_compute_the_same_and_hold_the_weights_once():
    model = tiny_llama(seed=6)
    tokens = [3, 9, 4, 4, 8]
    before = plain(model, tokens).logits
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    fuse_float_projections(model)
    fuse_float_projections(model)  # fused already: left as it is
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attention.qkv_proj.out_features == attention.q_proj.out_features + 2 * attention.k_proj.out_features
    assert attention.v_proj.weight.untyped_storage().data_ptr() == attention.qkv_proj.weight.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_proj.weight.untyped_storage().data_ptr()
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) < len(storages)
    torch.testing.assert_close(plain(model, tokens).logits, before, rtol=0, atol=0)  # transformers' forward
    assert not any("qkv_proj" in key or "gate_up_proj" in key for key in model.state_dict())  # keys as they were
    step = TargetStep(model)
    assert step.forward.qkv[0] is attention.qkv_proj and step.forward.gate_up[0] is mlp.gate_up_proj
    cache = StaticCache.for_model(model.config, 1, 16, torch.float32, "cpu")
    with torch.inference_mode():
        logits, _ = run(step, cache, [tokens])
    torch.testing.assert_close(logits[0], before[0], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable()}")
def test_an_eager_steps_fused_norm_and_rotary_calls_compute_what_pytorch_does(target, monkeypatch):
    """Eager float32 steps run a layer's norms, and its rotary embedding with the cache writes, one call each
    (``layer_kernel.cpp``): the rotary embedding equals PyTorch's bit for bit, k rotated and v land where the cache's
    row and write positions say and nowhere else, a norm's rows do not depend on the rest of the batch, and a
    whole step gives what the same step through PyTorch's operations gives."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, heads * 8, generator=generator) for heads in (4, 2, 2))
    cos, sin = (torch.randn(2, 3, 1, 8, generator=generator) for _ in range(2))
    keys, values = torch.zeros(3, 2, 10, 8), torch.zeros(3, 2, 10, 8)
    where, write = torch.tensor([[2], [0]]), torch.tensor([[4, 5, 6], [0, 1, 2]])
    rotated = torch.ops.fuzzyspec_layer.rope_store(q, k, v, cos, sin, keys, values, where, write, 4, 2)
    assert torch.equal(rotated, rotate(q.view(2, 3, 4, 8), cos, sin))
    expected_keys, expected_values = torch.zeros_like(keys), torch.zeros_like(values)
    expected_keys[where, :, write] = rotate(k.view(2, 3, 2, 8), cos, sin)
    expected_values[where, :, write] = v.view(2, 3, 2, 8)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    with pytest.raises(RuntimeError, match="past the cache's end"):  # refused before anything is written
        torch.ops.fuzzyspec_layer.rope_store(q, k, v, cos, sin, keys, values, where, write + 5, 4, 2)
    assert torch.equal(keys, expected_keys)
    # a float16 cache (a 4-bit target's) gets the same numbers rounded to the nearest, as PyTorch's assignment does
    half_keys, half_values = torch.zeros(3, 2, 10, 8, dtype=torch.float16), torch.zeros(3, 2, 10, 8, dtype=torch.float16)
    again = torch.ops.fuzzyspec_layer.rope_store(q, k, v, cos, sin, half_keys, half_values, where, write, 4, 2)
    assert torch.equal(again, rotated)
    assert torch.equal(half_keys, expected_keys.half()) and torch.equal(half_values, expected_values.half())

    norm = target.model.layers[0].input_layernorm
    x = torch.randn(5, 7, norm.weight.shape[0], generator=generator)
    with torch.inference_mode():
        together = rms_norm(norm, x)
        alone = torch.cat([rms_norm(norm, x[i: i + 1, j: j + 1]) for i in range(5) for j in range(7)])
    assert torch.equal(together.reshape(35, -1), alone.reshape(35, -1))
    monkeypatch.setattr(step_module, "fused_eager", lambda x: False)
    with torch.inference_mode():
        torch.testing.assert_close(together, rms_norm(norm, x), rtol=1e-6, atol=1e-6)
    results = []
    for fused in (False, True):
        monkeypatch.setattr(step_module, "fused_eager", lambda x, fused=fused: fused)
        cache = StaticCache.for_model(target.config, 2, 16, torch.float32, "cpu")
        with torch.inference_mode():
            first, _ = run(TargetStep(target), cache, [[3, 9, 4, 4], [8, 1, 2, 7]])
            second, _ = run(TargetStep(target), cache, [[5, 6], [2, 2]])
        results.append((first, second, cache.keys[1].clone(), cache.values[1].clone()))
    for unfused, fused in zip(*results):
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)


def test_eager_attention_takes_the_mask_as_scores():
    model = tiny_llama(seed=4)
    model.set_attn_implementation("eager")
    step = TargetStep(model, own=False)
    cache = StaticCache.for_model(model.config, 1, 16, torch.float32, "cpu")
    with torch.inference_mode():
        logits, _ = run(step, cache, [[5, 6, 7, 8]])
    torch.testing.assert_close(logits[0], plain(model, [5, 6, 7, 8]).logits[0], rtol=1e-4, atol=1e-4)


def test_the_cache_grows_keeping_what_it_holds(target):
    step = TargetStep(target)
    cache = StaticCache.for_model(target.config, 1, 8, torch.float32, "cpu")
    with torch.inference_mode():
        run(step, cache, [[3, 9, 4, 4, 8]])
        cache.lengths = [5]
        assert cache.fits(3) and not cache.fits(4)
        cache.grow(slots=2, capacity=16)
        assert (cache.slots, cache.capacity, cache.lengths) == (2, 16, [5, 0]) and cache.fits(11)
        logits, _ = run(step, cache, [[1, 2, 3, 4, 5, 6, 7]])
    torch.testing.assert_close(logits[0, -1], plain(target, [3, 9, 4, 4, 8, 1, 2, 3, 4, 5, 6, 7]).logits[0, -1],
                               rtol=1e-4, atol=1e-4)


def test_compiled_steps_equal_eager_ones_at_padded_shapes(target):
    """The compiled step runs at bucketed shapes: a width of 3 is padded to 4 and one row to one."""
    eager, compiled = TargetStep(target), TargetStep(target, compile=True, widths=(1, 4))
    assert compiled.shape(3, 1) == (4, 1) and compiled.shape(1, 3) == (1, 4) and eager.shape(3, 1) == (3, 1)
    results = []
    for step in (eager, compiled):
        cache = StaticCache.for_model(target.config, 1, 16, torch.float32, "cpu")
        with torch.inference_mode():
            run(step, cache, [[3, 9, 4, 1]])
            cache.lengths = [4]
            tree = torch.eye(4, dtype=torch.bool)[None].clone()
            tree[0, :3, :3] = chain_tree(1, 3, "cpu")[0]  # the fourth column is padding: it sees itself only
            logits, _ = run(step, cache, [[6, 11, 12, 0]], tree, compiled=True)
        results.append(logits[0, :3])
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results[0][-1], plain(target, [3, 9, 4, 1, 6, 11, 12]).logits[0, -1],
                               rtol=1e-4, atol=1e-4)


def test_compiled_calls_already_seen_still_run_their_own_graph(target):
    """Calls like ones already run skip most of dynamo's guards: each must still get the graph of its own model,
    cache size and slot count, alternating between them, as eager steps do."""
    other = tiny_llama(vocab_size=32, layers=2, seed=5)
    steps = {model: (TargetStep(model), TargetStep(model, compile=True, widths=(1, 4))) for model in (target, other)}
    shapes = [(1, 16, [[3, 9]]), (2, 16, [[3, 9], [4, 1]]), (1, 32, [[3, 9]])]  # (slots, capacity, rows' tokens)
    with torch.inference_mode():
        for _ in range(2):
            for model, (eager, compiled) in steps.items():
                for slots, capacity, prompt in shapes:
                    results = []
                    for step in (eager, compiled):
                        cache = StaticCache.for_model(model.config, slots, capacity, torch.float32, "cpu")
                        run(step, cache, prompt)
                        cache.lengths = [2] * len(prompt)
                        logits, _ = run(step, cache, [[7]] * len(prompt), compiled=True)
                        results.append(logits)
                    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)
