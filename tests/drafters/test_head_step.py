import copy

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import tiny_llama
from fuzzyspec.core import kept, kernels
from fuzzyspec.core.int4 import round_linears
from fuzzyspec.core.kvcache import HEAD_CAPACITY, DraftCache, crop_to
from fuzzyspec.core.vocab import DraftVocab
from fuzzyspec.drafters.eagle3 import make_eagle3
from fuzzyspec.drafters.eagle_head import EagleHead
from fuzzyspec.drafters.head_step import WIDTHS, HeadStep, ModuleStep, head_step

V = 32


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=V, layers=2, seed=2)


@pytest.fixture(scope="module")
def head(model):
    torch.manual_seed(3)
    return EagleHead.for_target(model).eval()


def calls(step, cache, tokens, features, compiled):
    """The calls a drafter makes: the prompt's true features, a chain token fed its own prediction, a tree level
    (two nodes, siblings, each seeing the cache and itself) dropped again, then accepted tokens' features."""
    out = [step(cache, tokens[:, 1:40], features[:, :39], compiled=compiled)]
    out.append(step(cache, tokens[:, 40:41], out[-1][:, -1:], compiled=compiled))
    base = cache.get_seq_length()
    allowed = torch.ones(2, base + 2, dtype=torch.bool)
    allowed[0, base + 1] = allowed[1, base] = False
    out.append(step(cache, tokens[:, 41:43], out[-1].expand(1, 2, -1), torch.tensor([[base, base]]), allowed,
                    compiled=compiled))
    crop_to(cache, 39)
    out.append(step(cache, tokens[:, 40:43], features[:, 39:42], compiled=compiled))
    return out


@pytest.mark.parametrize("compiled", [False, True])
def test_head_step_equals_the_heads_own_layer(model, head, compiled):
    """Our flat step over a static cache gives the head's outputs as transformers' layer over a growing cache does,
    call for call (causal, a tree level's mask, a crop), eager and compiled at padded widths, and past its cache's
    first capacity (it grows)."""
    embed = model.get_input_embeddings()
    step = HeadStep(head, embed)
    assert step.heads.invariant  # float32 on a CPU: our attention kernel (bfloat16 below: PyTorch's)
    reference = ModuleStep(head, embed)
    tokens = torch.randint(0, V, (1, 43), generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, 43, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = calls(step, step.new_cache(), tokens, features, compiled)
        theirs = calls(reference, DraftCache(), tokens, features, False)
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
        graphs = counters["stats"]["unique_graphs"]
        cache = step.new_cache()
        long = torch.randint(0, V, (1, HEAD_CAPACITY + 3))
        step(cache, long[:, : HEAD_CAPACITY - 1], torch.randn(1, HEAD_CAPACITY - 1, model.config.hidden_size))
        grown = step(cache, long[:, HEAD_CAPACITY - 1: HEAD_CAPACITY + 2],
                     torch.randn(1, 3, model.config.hidden_size), compiled=compiled)
        calls(step, step.new_cache(), tokens, features, compiled)
    assert cache.capacity == 2 * HEAD_CAPACITY and cache.length == HEAD_CAPACITY + 2 and grown.shape[1] == 3
    if compiled:  # shapes met again compile nothing: not a larger cache, nor slices of a longer row (their strides)
        assert {width for width, _ in step._kept.calls} <= set(WIDTHS)
        assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("compiled", [False, True])
def test_a_call_written_where_the_device_says_is_the_one_written_at_the_caches_length(model, head, compiled):
    """Inside a captured tree (``EagleDrafter._tree`` on a GPU) a level's call is written at a start given as a tensor,
    its mask made on the device: two tree levels, the second seeing some of the first, give the outputs of the same
    calls written at the cache's length, and leave the length where it was."""
    step = HeadStep(head, model.get_input_embeddings())
    tokens = torch.randint(0, V, (1, 46), generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, 46, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    own = torch.eye(3, dtype=torch.bool)
    levels = [own, torch.cat([own[[0, 0, 2]], own], 1)]  # (the second level's nodes hang from nodes 0, 0 and 2)
    outputs = {}
    with torch.inference_mode():
        for given in (False, True):
            cache = step.new_cache()
            step(cache, tokens[:, 1:40], features[:, :39], compiled=compiled)
            base, found = cache.length, []
            for level, allowed in enumerate(levels):
                where = {"start": torch.tensor([base + 3 * level])} if given else {}
                fed, positions = features[:, 39 + level].expand(1, 3, -1), torch.full((1, 3), base + level)
                found.append(step(cache, tokens[:, 40 + 3 * level: 43 + 3 * level], fed, positions, allowed,
                                  compiled=compiled, **where))
            assert cache.length == (base if given else base + 6)
            outputs[given] = found
    for a, b in zip(outputs[False], outputs[True]):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()


def test_one_step_per_head_and_the_others_run_as_their_module(model, head):
    embed = model.get_input_embeddings()
    assert head_step(head, embed) is head_step(head, embed)
    assert isinstance(head_step(head, embed), HeadStep)
    eagle3 = make_eagle3(model, DraftVocab(torch.arange(0, V, 2), V))
    assert isinstance(head_step(eagle3, embed), ModuleStep)


def test_head_step_in_bfloat16_runs_through_pytorchs_attention(model, head):
    """Where our attention kernel does not serve (bfloat16 here; any GPU), the step attends through PyTorch's SDPA,
    and still gives the head's own outputs (to bfloat16's precision)."""
    import copy

    target, draft = copy.deepcopy(model).to(torch.bfloat16), copy.deepcopy(head).to(torch.bfloat16)
    embed = target.get_input_embeddings()
    step = HeadStep(draft, embed)
    assert not step.heads.invariant
    tokens = torch.randint(0, V, (1, 43), generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, 43, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = calls(step, step.new_cache(), tokens, features.bfloat16(), False)
        theirs = calls(ModuleStep(draft, embed), DraftCache(), tokens, features.bfloat16(), False)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a.float(), b.float(), atol=0.05, rtol=0.02), (a - b).abs().max()


def test_a_gone_drafters_cache_serves_the_next_one(model, head):
    """CUDA graphs are captured over a cache's tensors: a new answer's drafter gets a cache whose drafter is gone
    (same tensors, emptied), not new ones; drafters alive together never share one."""
    import gc

    class Owner:
        pass

    step = HeadStep(head, model.get_input_embeddings())
    first, second = Owner(), Owner()
    a, b = step.borrow_cache(first), step.borrow_cache(second)
    assert a is not b
    a.length = 7
    keys = a.keys.data_ptr()
    del first
    gc.collect()
    third = Owner()
    c = step.borrow_cache(third)
    assert c is a and c.length == 0 and c.keys.data_ptr() == keys
    assert step.borrow_cache(Owner()) is not b  # (b's owner is alive)


def test_prepared_widths_are_kept_graphs_for_every_capacity_and_give_the_same_outputs(model, head, tmp_path,
                                                                                     monkeypatch):
    """``prepare`` compiles every width ahead as a kept graph (``core.kept``: no dynamo, no guards, one graph for
    every capacity): a drafter's calls, at the prepared capacity and past it, give the eager step's outputs and
    compile nothing more; a later step of the same head loads the graphs instead of compiling them."""
    monkeypatch.setattr(kept, "folder", lambda: tmp_path)
    embed = model.get_input_embeddings()
    step = HeadStep(head, embed)
    step.prepare(HEAD_CAPACITY)
    assert set(step._kept.calls) == {(width, torch.float32) for width in WIDTHS}
    tokens = torch.randint(0, V, (1, 43), generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, 43, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        graphs = counters["stats"]["unique_graphs"]
        ours = calls(step, step.new_cache(), tokens, features, True)
        longer = step(step.new_cache(2 * HEAD_CAPACITY), tokens[:, :1], features[:, :1], compiled=True)
        assert counters["stats"]["unique_graphs"] == graphs and len(step._kept.calls) == len(WIDTHS)
        eager = calls(step, step.new_cache(), tokens, features, False)
        for a, b in zip(ours, eager):
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
        assert torch.allclose(longer, step(step.new_cache(), tokens[:, :1], features[:, :1]), atol=1e-5)

    def refuse(*_):
        raise AssertionError("compiled again")
    monkeypatch.setattr(kept.Kept, "_compile", refuse)
    later = HeadStep(head, embed)
    later.prepare(HEAD_CAPACITY)
    assert later._kept is not None and set(later._kept.calls) == set(step._kept.calls)


def test_a_head_that_cannot_be_compiled_ahead_warns_once_and_runs_through_dynamo(model, head, tmp_path,
                                                                                monkeypatch):
    """Where a first kept graph cannot be compiled (a function dynamo cannot take whole, a torch without
    ``aot_compile``), the head says so in one line and its compiled calls still give the eager step's outputs."""
    monkeypatch.setattr(kept, "folder", lambda: tmp_path)

    def fail(*_):
        raise RuntimeError("aot_compile is missing\nand more")
    monkeypatch.setattr(kept.Kept, "_compile", fail)
    step = HeadStep(head, model.get_input_embeddings())
    tokens = torch.randint(0, V, (1, 43), generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, 43, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        with pytest.warns(UserWarning, match=r"the EAGLE head's step could not be compiled ahead \(RuntimeError: "
                                             r"aot_compile is missing\)") as warned:
            ours = calls(step, step.new_cache(), tokens, features, True)
        assert len(warned) == 1 and step._kept is None and step._compiled is not None
        for a, b in zip(ours, calls(step, step.new_cache(), tokens, features, False)):
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


@pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable()}")
def test_an_8_bit_heads_input_in_one_call_gives_the_same_numbers(model, head):
    """Beside a 4-bit target a head's layers are 8-bit (``round_linears``), and an eager step computes
    fc([embedding ; feature]) + bias in one call (``fuzzyspec_int4.head_input``), where it made four operations:
    the same outputs bit for bit, call for call; a token id past the embedding, or features not one a token, are
    refused in one line."""
    rounded = copy.deepcopy(head)
    round_linears(rounded)
    embed = model.get_input_embeddings()
    step = HeadStep(rounded, embed)
    assert step._input is not None and rounded.fc.bias is not None
    apart = HeadStep(rounded, embed)
    apart._input = None
    tokens = torch.randint(0, V, (1, 43), generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, 43, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for a, b in zip(calls(step, step.new_cache(), tokens, features, False),
                        calls(apart, apart.new_cache(), tokens, features, False)):
            assert torch.equal(a, b)
        without_bias = step._input[:2] + (embed.weight.new_empty(0),)
        assert torch.equal(torch.ops.fuzzyspec_int4.head_input(tokens[:, :5], features[:, :5], *without_bias),
                           torch.ops.fuzzyspec_int4.mm_q8(torch.cat([embed(tokens[:, :5]), features[:, :5]], -1),
                                                          rounded.fc.packed))
        with pytest.raises(RuntimeError, match=f"head_input: a token id past the {V} rows"):
            torch.ops.fuzzyspec_int4.head_input(torch.tensor([[V]]), features[:, :1], *step._input)
        with pytest.raises(RuntimeError, match="head_input: features"):  # (as many, but not token for token)
            torch.ops.fuzzyspec_int4.head_input(tokens[:, :5].T.contiguous(), features[:, :5], *step._input)
