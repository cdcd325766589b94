"""Int4 linear layers: the kernel's formula, and a model holding them decodes as its own target."""
import pytest
import torch

from conftest import run_step, tiny_llama
from fuzzyspec.core import int4, kernels
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.engine import decode
from fuzzyspec.core.int4 import GROUP, Int4Linear, Int8Linear, pack_eight, q8_sums
from fuzzyspec.core.kvcache import StaticCache
from fuzzyspec.core.step import TargetStep
from fuzzyspec.drafters.model import ModelDrafter

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable()}")


def rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far x @ W.T may move when each block of 32 activations is rounded to 8 bits, as the kernel does:
    each activation by at most half its block's step, max|x| / 127 / 2 (plus float32 rounding)."""
    steps = x.reshape(*x.shape[:-1], -1, GROUP).abs().amax(-1) / 127 / 2
    return steps.repeat_interleave(GROUP, -1) @ weight.abs().T * 1.001 + 1e-5


def test_the_layer_computes_with_its_codes_scales_and_minimums():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 64), generator=generator, dtype=torch.int32)
    scales = (torch.rand(48, 2, generator=generator) * 0.1 + 0.01).half()
    minimums = (torch.randn(48, 2, generator=generator) * 0.1).half()
    layer = Int4Linear.from_codes(codes, scales, minimums)
    assert torch.equal(layer.codes(), codes)  # the codes, two a byte, as llama.cpp stores them
    expected = codes.float() * scales.float().repeat_interleave(GROUP, 1) + minimums.float().repeat_interleave(GROUP, 1)
    assert torch.equal(layer.weight(), expected)
    x = torch.randn(5, 64, generator=generator)
    assert ((layer(x) - x @ expected.T).abs() <= rounding_bound(x, expected)).all()
    assert layer(x).dtype == torch.float32 and (layer.in_features, layer.out_features) == (64, 48)
    with pytest.raises(ValueError, match="blocks of 32"):
        Int4Linear.from_codes(codes[:, :40], scales, minimums)


@pytest.mark.parametrize("out_features", [50, 64])
def test_a_tokens_result_does_not_depend_on_its_batch(out_features):
    """The kernel computes each output by the same operations for any number of tokens and rows (tiles of 1-8
    tokens, one or two groups of 16 rows, the last group padded): a verification step's logits for a position are
    a single step's, bit for bit."""
    generator = torch.Generator().manual_seed(2)
    layer = Int4Linear.from_codes(torch.randint(0, 16, (out_features, 96), generator=generator),
                                  torch.rand(out_features, 3, generator=generator) * 0.1,
                                  torch.randn(out_features, 3, generator=generator) * 0.1)
    head = Int8Linear.from_codes(torch.randint(-128, 128, (out_features, 96), generator=generator),
                                 torch.rand(out_features, 3, generator=generator) * 0.01)
    x = torch.randn(19, 96, generator=generator)
    for module in (layer, head):
        alone = torch.cat([module(x[i: i + 1]) for i in range(len(x))])
        for count in range(1, len(x) + 1):
            assert torch.equal(module(x[:count]), alone[:count])


def test_an_8_bit_layer_is_its_codes_times_its_scales_and_its_rows_keep_them():
    """Q8_0's codes (-128..127) at their own bytes: the product is x @ (scale * q).T, up to rounding the
    activations to 8 bits; a reduced vocabulary's rows (``rows``) give those rows' outputs exactly."""
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(-128, 128, (64, 96), generator=generator, dtype=torch.int32)
    codes[0] = torch.tensor([-128, 127, 0] * 32)  # the extremes
    scales = (torch.rand(64, 3, generator=generator) * 0.01).half()
    scales[5, 1] = 0.0  # an all-zero block
    layer = Int8Linear.from_codes(codes, scales)
    weight = codes.float() * scales.float().repeat_interleave(GROUP, 1)
    assert torch.equal(layer.weight, weight)
    x = torch.randn(4, 96, generator=generator)
    x[1, :32] = 0.0  # an all-zero block of activations
    assert ((layer(x) - x @ weight.T).abs() <= rounding_bound(x, weight)).all()
    index = torch.tensor([5, 0, 17, 63, 2, 9, 11])
    rows = layer.rows(index)
    assert torch.equal(rows.weight, weight[index]) and torch.equal(rows.scales(), scales[index])
    assert torch.equal(rows(x), layer(x)[:, index])


def test_an_8_bit_block_holds_its_code_sums_only_where_the_kernels_read_them():
    """The AVX-512 build's products take each row's code sums back off; the other builds never read them, so their
    blocks leave them out (11% fewer bytes to stream). Either way the codes and scales come back as they went in,
    and a kernel refuses the other layout in one line rather than reading past its blocks."""
    generator = torch.Generator().manual_seed(4)
    codes = torch.randint(-128, 128, (32, 96), generator=generator, dtype=torch.int32)
    scales = (torch.rand(32, 3, generator=generator) * 0.01).half()
    with_sums, without = pack_eight(codes, scales, sums=True), pack_eight(codes, scales, sums=False)
    assert with_sums.shape == (2, 3, 608) and without.shape == (2, 3, 544)
    assert torch.equal(with_sums[..., :544], without)
    sums = with_sums[..., 544:].contiguous().view(torch.int32)  # [groups, blocks, 16 rows]
    assert torch.equal(sums.transpose(1, 2).reshape(32, 3), codes.reshape(32, 3, GROUP).sum(-1, dtype=torch.int32))
    layer = Int8Linear.from_codes(codes, scales)
    assert layer.packed.shape[-1] == (608 if q8_sums() else 544)
    assert torch.equal(layer.codes().int(), codes) and torch.equal(layer.scales(), scales)
    other = pack_eight(codes, scales, sums=not q8_sums())
    with pytest.raises(RuntimeError, match=rf"a packed weight \[groups, 3, {layer.packed.shape[-1]}\] bytes"):
        torch.ops.fuzzyspec_int4.mm_q8(torch.randn(1, 96), other)


def same_steps(results: list) -> tuple[list, list]:
    """Two ways' (outputs of their steps, cache keys, cache values): the same logits, features and cache, bit for
    bit. Returns the first way's keys and values."""
    (seen, keys, values), (expected, expected_keys, expected_values) = results
    for (logits, found), (expected_logits, expected_found) in zip(seen, expected):
        assert torch.equal(logits, expected_logits)
        assert found.keys() == expected_found.keys() and all(torch.equal(found[i], expected_found[i]) for i in found)
    assert all(map(torch.equal, keys + values, expected_keys + expected_values))
    return keys, values


def int4_model(seed: int, fused: bool = False, hidden: int = 32) -> torch.nn.Module:
    model = tiny_llama(seed=seed, hidden=hidden)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, Int4Linear.rounded(child.weight.data))
    if fused:
        int4.fuse_projections(model)
    return model


def test_fused_projections_compute_each_layers_outputs_side_by_side():
    model = int4_model(seed=1, fused=True)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = torch.randn(4, 32)
    assert torch.equal(attention.qkv_proj(x), torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], -1))
    assert torch.equal(mlp.gate_up_proj(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1))
    # the separate layers read the fused codes: one copy in memory
    for fused, part in ((mlp.gate_up_proj, mlp.up_proj), (attention.qkv_proj, attention.v_proj)):
        assert part.packed.untyped_storage().data_ptr() == fused.packed.untyped_storage().data_ptr()


@pytest.mark.parametrize("compile,fused", [(False, False), (False, True), (True, True)])
def test_an_int4_target_decodes_losslessly_through_our_step(draft, compile, fused):
    """sd reproduces the int4 target exactly: the engine's own forward (eager or compiled, with the projections
    fused or not) gives the greedy text of transformers' generate on the same int4 model (whose float32 cache
    moves these logits by far less than their margins; our step's is float16)."""
    model = int4_model(seed=0, fused=fused)
    prompt = torch.tensor([[1, 5, 9, 3, 7, 2]])
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False)[0, 6:].tolist()
    step = TargetStep(model, compile=compile)
    for method in ("ar", "sd"):
        tokens, stats = decode(step, ModelDrafter(draft, 32), prompt, DecodeConfig(method=method, max_new_tokens=20), 32)
        assert tokens[0].tolist() == expected



@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
def test_a_4bit_layer_in_one_call_gives_what_its_separate_ops_give(cache_dtype):
    """An eager float32 step of a 4-bit target runs each decoder layer in one call (``step.whole_layer``): the same
    kernels in the same order as the layer's separate ops, so the same logits, hidden states and cache, bit for bit,
    for rows of different lengths, a tree, and a row joining into a slot of its own; a position past the cache's
    end is refused with one line before anything is written."""
    from fuzzyspec.core.kvcache import attention_mask, chain_tree, write_positions

    model = int4_model(seed=3, fused=True, hidden=64)
    whole, separate = TargetStep(model), TargetStep(model)
    separate.forward.whole = None
    assert whole.forward.whole is not None and len(whole.forward.whole) == 2
    tree = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    results = []
    for step in (whole, separate):
        cache = StaticCache.for_model(model.config, 3, 32, cache_dtype, "cpu")
        seen = []
        with torch.inference_mode():
            cache.lengths = [0, 0]
            seen.append(run_step(step, cache, [[3, 9, 4, 4, 8], [7, 1, 2, 5, 6]], features=(0, 1, 2)))
            cache.lengths = [3, 5]
            seen.append(run_step(step, cache, [[6, 11, 12, 13], [2, 2, 3, 1]], tree.expand(2, 4, 4),
                                 torch.tensor([[0, 1, 1, 2]] * 2)))
            starts = torch.tensor([0])  # a row joining in slot 2
            seen.append(step(cache, torch.tensor([[5, 4, 3]]), write_positions(starts, 3), write_positions(starts, 3),
                             attention_mask(starts, chain_tree(1, 3, "cpu"), cache.capacity), torch.tensor([2])))
        results.append((seen, cache.keys, cache.values))
    keys, values = same_steps(results)
    before = [t.clone() for t in keys]
    layer = model.model.layers[0]
    h, cos, sin = torch.randn(1, 2, 64), torch.ones(1, 2, 1, 16), torch.zeros(1, 2, 1, 16)
    with pytest.raises(RuntimeError) as refused:
        torch.ops.fuzzyspec_layer.decoder_layer(h, *whole.forward.whole[0], cos, sin, keys[0], values[0],
                                                torch.tensor([[0]]), torch.tensor([[31, 32]]),
                                                torch.ones(1, 1, 2, 32, dtype=torch.bool), 4, 2, 0.25)
    assert str(refused.value).splitlines()[0] == "decoder_layer: a position past the cache's end"
    assert all(map(torch.equal, keys, before)) and layer.self_attn.qkv_proj.packed.shape[0] > 0


def test_a_4bit_models_layers_in_one_call_give_what_a_call_a_layer_gives(monkeypatch):
    """An eager float32 step of a 4-bit target whose drafter asks for no inner layer's input runs all its layers in one
    call (``fuzzyspec_layer.decoder_layers``), its final norm too: the same logits, features and cache, bit for bit,
    as a call a layer and the norm's own call, batched and over a tree; an inner layer asked for takes a call a
    layer; a position past the cache's end is refused before any layer's cache is written."""
    from fuzzyspec.core import step as step_module

    model = int4_model(seed=4, fused=True, hidden=64)
    assert len(model.model.layers) == 2
    stacked, layered = TargetStep(model), TargetStep(model)
    assert stacked.forward.final[0].numel() > 0  # (the final norm in the one call)
    layered.forward.stacked = None
    one_layer = step_module.decoder_layer
    calls = []
    monkeypatch.setattr(step_module, "decoder_layer", lambda *args, **kwargs: calls.append(1) or one_layer(*args,
                                                                                                            **kwargs))
    tree = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    results = []
    for step in (stacked, layered):
        cache = StaticCache.for_model(model.config, 2, 32, torch.float16, "cpu")
        seen = []
        with torch.inference_mode():
            cache.lengths = [0, 0]
            seen.append(run_step(step, cache, [[3, 9, 4, 4, 8], [7, 1, 2, 5, 6]], features=(0, 2)))
            cache.lengths = [3, 5]
            seen.append(run_step(step, cache, [[6, 11, 12, 13], [2, 2, 3, 1]], tree.expand(2, 4, 4),
                                 torch.tensor([[0, 1, 1, 2]] * 2), features=(2,)))
            cache.lengths = [7, 9]
            seen.append(run_step(step, cache, [[4], [5]], features=(1, 2)))  # (an inner layer: a call a layer)
        results.append((seen, cache.keys, cache.values))
        assert len(calls) == (2 if step is stacked else 6)
        calls.clear()
    keys, values = same_steps(results)
    before = [t.clone() for t in keys + values]
    h, cos, sin = torch.randn(1, 2, 64), torch.ones(1, 2, 1, 16), torch.zeros(1, 2, 1, 16)
    with pytest.raises(RuntimeError) as refused:
        torch.ops.fuzzyspec_layer.decoder_layers(h, *stacked.forward.stacked, cos, sin, keys, values,
                                                 torch.tensor([[0]]), torch.tensor([[31, 32]]),
                                                 torch.ones(1, 1, 2, 32, dtype=torch.bool), 4, 2, 0.25,
                                                 *stacked.forward.final)
    assert str(refused.value).splitlines()[0] == "decoder_layer: a position past the cache's end"
    assert all(map(torch.equal, keys + values, before))


def test_the_embedding_and_angles_inside_the_layers_call_give_what_their_own_calls_give(monkeypatch):
    """Where no layer's input is asked for, an eager step of a 4-bit target looks up its tokens' embeddings and
    rotary angles inside the layers' one call (``fuzzyspec_layer.embedded_layers``): the same logits, features and
    cache, bit for bit, as the lookup and the angles' own calls, batched, over a tree, a joining row in its own slot
    and past the angles kept so far; a position past them or a token past the table is refused before any layer's
    cache is written."""
    from fuzzyspec.core.kvcache import attention_mask, chain_tree, write_positions
    from fuzzyspec.core.llama import Rotary

    model = int4_model(seed=6, fused=True, hidden=64)
    model.model.rotary_emb = Rotary(model.config)  # (ours, as a GGUF target has: its angles are kept in a table)
    inside, apart = TargetStep(model), TargetStep(model)
    apart.forward.lookup = False
    assert inside.forward.lookup
    one_call = torch.ops.fuzzyspec_layer.embedded_layers
    calls = []
    monkeypatch.setattr(torch.ops.fuzzyspec_layer, "embedded_layers",
                        lambda *args: calls.append(1) or one_call(*args), raising=False)
    tree = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    results = []
    for step in (inside, apart):
        cache = StaticCache.for_model(model.config, 3, 512, torch.float16, "cpu")
        seen = []
        with torch.inference_mode():
            cache.lengths = [0, 0]
            seen.append(run_step(step, cache, [[3, 9, 4, 4, 8], [7, 1, 2, 5, 6]]))
            cache.lengths = [3, 5]
            seen.append(run_step(step, cache, [[6, 11, 12, 13], [2, 2, 3, 1]], tree.expand(2, 4, 4),
                                 torch.tensor([[0, 1, 1, 2]] * 2), features=(2,)))
            cache.lengths = [300, 400]  # (past the 256 angles a first table holds)
            seen.append(run_step(step, cache, [[4, 1], [5, 0]], features=(2,)))
            starts = torch.tensor([0])  # a row joining in slot 2
            seen.append(step(cache, torch.tensor([[5, 4, 3]]), write_positions(starts, 3), write_positions(starts, 3),
                             attention_mask(starts, chain_tree(1, 3, "cpu"), cache.capacity), torch.tensor([2])))
        results.append((seen, cache.keys, cache.values))
    assert len(calls) == 4
    keys, values = same_steps(results)
    before = [t.clone() for t in keys + values]
    angles = model.model.rotary_emb.table(torch.float32, 512)
    weight = model.model.embed_tokens.weight
    for tokens, positions, problem in (([[1, 2]], [[600, 601]], "a position past the 512 angles kept"),
                                       ([[1, 10**6]], [[3, 4]], f"a token id past the {weight.shape[0]} rows")):
        with pytest.raises(RuntimeError) as refused:
            one_call(torch.tensor(tokens), weight, angles[:, :512], torch.tensor(positions), *inside.forward.stacked,
                     keys, values, torch.tensor([[0]]), torch.tensor([[3, 4]]),
                     torch.ones(1, 1, 2, 512, dtype=torch.bool), 4, 2, 0.25, *inside.forward.final)
        assert str(refused.value).splitlines()[0] == f"embedded_layers: {problem}"
    assert all(map(torch.equal, keys + values, before))


def test_an_8bit_layer_without_an_input_norm_in_one_call_gives_what_its_separate_ops_give():
    """The same call serves an EAGLE head's layer as a 4-bit target's drafter holds it: 8-bit projections, q, k
    and v (gate and up) separate, packed side by side for the call, and no input norm. Its separate ops take PyTorch's
    silu, so the two agree to float32's rounding rather than bit for bit."""
    model = tiny_llama(seed=5, hidden=64)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, Int8Linear.rounded(child))
    model.model.layers[0].input_layernorm = torch.nn.Identity()
    whole, separate = TargetStep(model), TargetStep(model)
    separate.forward.whole = None
    assert whole.forward.whole is not None and whole.forward.whole[0][0].numel() == 0
    results = []
    for step in (whole, separate):
        cache = StaticCache.for_model(model.config, 2, 32, torch.float32, "cpu")
        with torch.inference_mode():
            cache.lengths = [0, 0]
            first, _ = run_step(step, cache, [[3, 9, 4, 4, 8], [7, 1, 2, 5, 6]])
            cache.lengths = [5, 5]
            second, _ = run_step(step, cache, [[6, 11], [2, 2]])
        results.append((first, second, *cache.keys, *cache.values))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_4bit_target_caches_its_keys_and_values_in_float16_a_float_one_in_its_own_dtype(target):
    """Half the bytes a step reads at each cached position, as llama.cpp keeps them by default; only where our
    own forward and attention read the cache (transformers' forward keeps the weights' dtype)."""
    model = int4_model(seed=0)
    assert TargetStep(model).borrow_cache(2, 16).keys[0].dtype == torch.float16
    assert TargetStep(model, own=False).cache_dtype == torch.float32
    assert TargetStep(target).borrow_cache(2, 16).values[-1].dtype == torch.float32


@pytest.mark.parametrize("compile", [False, True])
def test_a_verification_scores_each_node_exactly_as_a_one_token_step(compile):
    """With every product through the int4 kernel and attention through ours (``core.attention``), a pass over a
    tree of drafts gives each node, bit for bit, the logits AR's one-token steps give the same tokens: so greedy
    sd cannot leave the int4 target's text at a near-tie (PyTorch's attention moved a 6-token chain's logits by
    up to 0.75 on the embedded model)."""
    model = int4_model(seed=2, fused=True, hidden=256)  # heads of 64 after 70 tokens: here SDPA fails this test
    model.lm_head = Int4Linear.rounded(model.lm_head.weight.data)
    step = TargetStep(model, compile=compile)
    assert step.forward.heads.invariant and step.cache_dtype == torch.float16

    def run(cache, tokens, tree=None, depths=None):
        logits, _ = run_step(step, cache, tokens, tree, depths, compiled=True)
        cache.lengths = [length + len(tokens[0]) for length in cache.lengths]
        return logits

    prefix = torch.randint(0, 32, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        cache = StaticCache.for_model(model.config, 1, 128, step.cache_dtype, "cpu")
        run(cache, [prefix])
        # newest token 6, then the tree: 11 and 12 below it, 13 below 11, 14 below 13
        tree = torch.tensor([[[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]],
                            dtype=torch.bool)
        verified = run(cache, [[6, 11, 12, 13, 14]], tree, torch.tensor([[0, 1, 1, 2, 3]]))
        for column, path in [(2, [6, 12]), (4, [6, 11, 13, 14])]:
            cache = StaticCache.for_model(model.config, 1, 128, step.cache_dtype, "cpu")
            run(cache, [prefix])
            for token in path:  # AR: one token a step
                one = run(cache, [[token]])
            assert torch.equal(verified[0, column], one[0, 0]), path


def test_a_float_layer_rounded_to_q8_0_keeps_its_bias_and_moves_by_the_rounding():
    generator = torch.Generator().manual_seed(4)
    linear = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=generator) * 0.1)
    layer = Int8Linear.rounded(linear)
    scales = layer.scales().float().repeat_interleave(GROUP, 1)
    assert (layer.codes().abs() <= 127).all()
    assert ((layer.codes().float() * scales - linear.weight).abs() <= scales / 2 + 1e-6).all()  # round to nearest
    x = torch.randn(3, 64, generator=generator)
    rounded = layer.codes().float() * scales
    assert ((layer(x) - (x @ rounded.T + linear.bias)).abs() <= rounding_bound(x, rounded)).all()


def test_a_float_weight_rounded_to_q4_1_moves_by_half_a_step_at_most():
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(40, 64, generator=generator)
    weight[3, :GROUP] = 0.25  # a block of one value: no range, nothing lost
    layer = Int4Linear.rounded(weight)
    steps = layer.scales().float().repeat_interleave(GROUP, 1)
    error = (layer.weight() - weight).abs()
    assert bool((error <= steps / 2 + 1e-3 * weight.abs() + 1e-6).all())  # (+ the float16 minimum's rounding)
    assert torch.equal(layer.weight()[3, :GROUP], torch.full((GROUP,), 0.25))
    assert layer.codes().min() == 0 and layer.codes().max() == 15  # each block spans the grid


def test_rounding_a_part_at_a_time_gives_the_bytes_of_one_pass(monkeypatch):
    """``Int4Linear.rounded`` rounds ``int4.ROUNDING_ROWS`` rows at a time (a drafter's LM head rows at every
    load), whole or the rows given by index, the last part short: the same bytes as rounding all at once."""
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(2 * int4.ROUNDING_ROWS + 40, 64, generator=generator)
    rows = torch.randperm(weight.shape[0], generator=generator)[: int4.ROUNDING_ROWS + 37].sort().values
    in_parts, rows_in_parts = Int4Linear.rounded(weight), Int4Linear.rounded(weight, rows)
    monkeypatch.setattr(int4, "ROUNDING_ROWS", 10 ** 6)
    assert torch.equal(in_parts.packed, Int4Linear.rounded(weight).packed)
    assert torch.equal(rows_in_parts.packed, Int4Linear.rounded(weight[rows]).packed)
    assert (rows_in_parts.out_features, rows_in_parts.in_features) == (len(rows), 64)


def test_a_reduced_draft_vocabulary_of_an_8_bit_head_reads_4_bit_rows_and_its_top_logits_exactly():
    """An EAGLE head with a draft vocabulary reads those rows of the target's LM head after every target pass;
    of a GGUF target's 8-bit head, they are kept in 4 bits, and each output's few highest logits are worked out
    again from the 8-bit rows, so the rounding does not move which token a draft proposes."""
    from fuzzyspec.core.vocab import RESCORED, DraftVocab, RoundedRows, reduced_lm_head

    generator = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    head = Int8Linear.rounded(torch.nn.Linear(64, 96, bias=False))
    ids = torch.arange(0, 96, 2)
    rows = reduced_lm_head(head, DraftVocab(ids, 96))
    assert isinstance(rows, RoundedRows) and isinstance(rows.rows, Int4Linear)
    assert (rows.out_features, rows.in_features) == (48, 64)
    x = torch.randn(2, 5, 64, generator=generator)  # (any leading shape: a tree level's nodes, a chain's one)
    exact = x @ head.weight[ids].T
    rounded, logits = rows.rows(x), rows(x)
    torch.testing.assert_close(rounded, exact, rtol=0.1, atol=0.1 * float(exact.abs().max()))
    top = rounded.topk(RESCORED, -1).indices
    torch.testing.assert_close(logits.gather(-1, top), exact.gather(-1, top))
    others = torch.ones_like(logits, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(logits[others], rounded[others])
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    few = torch.tensor([0, 5, 17, 40, 41, 95])  # fewer rows than RESCORED: every logit is worked out again
    torch.testing.assert_close(reduced_lm_head(head, DraftVocab(few, 96))(x), x @ head.weight[few].T)
    float_rows = reduced_lm_head(torch.nn.Linear(64, 96, bias=False), DraftVocab(ids, 96))
    assert type(float_rows) is torch.nn.Linear and float_rows.out_features == 48


def test_a_drafter_of_an_int4_target_reads_its_own_layers_at_8_bits_and_stays_lossless(tmp_path):
    """A small drafter's float32 products cost a 4-bit target's step half again per token: beside an int4
    target, a loaded drafter's layers are Q8_0 through the same kernel, and sd still gives the target's text."""
    from fuzzyspec.drafters.eagle_head import EagleHead
    from fuzzyspec.drafters.registry import load_drafter

    model = int4_model(seed=0, fused=True)
    torch.manual_seed(0)
    EagleHead.for_target(tiny_llama(seed=0)).save(tmp_path / "head")
    source = load_drafter(f"eagle:{tmp_path / 'head'}", model, None)
    linears = [m for m in source.module.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    assert linears and all(isinstance(m, Int8Linear) for m in linears)
    floats = load_drafter(f"eagle:{tmp_path / 'head'}", tiny_llama(seed=0), None).module
    assert not any(isinstance(m, Int8Linear) for m in floats.modules())  # a float target's drafter stays float
    prompt = torch.tensor([[1, 5, 9, 3, 7, 2]])
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False)[0, 6:].tolist()
    config = DecodeConfig(method="sd", max_new_tokens=20, gamma=3)
    tokens, _ = decode(TargetStep(model), source.new(32), prompt, config, 32)
    assert tokens[0].tolist() == expected
