import copy
import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_llama
from tree_reference import TREE_SHAPES, assert_grown_as_the_reference
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.draft import Budget
from fuzzyspec.core.graphs import Graphs
from fuzzyspec.core.engine import Engine, decode
from fuzzyspec.core.step import TargetStep
from fuzzyspec.core.kvcache import DraftCache, crop_to
from fuzzyspec.drafters.eagle import EagleDrafter, load_any_head
from fuzzyspec.drafters.eagle_head import EagleHead, load_head
from fuzzyspec.core.sampling import Sampling
from fuzzyspec.core.vocab import DraftVocab

V = 32


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=V, layers=2, seed=2)


@pytest.fixture(scope="module")
def head(model):
    torch.manual_seed(3)
    return EagleHead.for_target(model).eval()


def features_of(model, tokens):
    with torch.no_grad():
        return model(tokens, output_hidden_states=True).hidden_states[-1]


def logits_from_scratch(model, head, sequence):
    """The head's logits for the token after ``sequence``, run over the target's true features of all of it."""
    f = features_of(model, sequence[:, :-1])
    with torch.no_grad():
        e = model.get_input_embeddings()(sequence[:, 1:])
        return model.get_output_embeddings()(head(e, f)[:, -1])


def test_cached_forward_equals_full_forward(model, head):
    """The head fed in pieces over its DraftCache, past the cache's first room (it grows), and cropped back and fed
    again (as drafting drops the positions a tree computed from predictions), gives what one pass over it all does."""
    tokens = torch.randint(0, V, (1, 91), generator=torch.Generator().manual_seed(0))
    f, e = features_of(model, tokens), model.get_input_embeddings()(tokens)
    with torch.no_grad():
        full = head(e[:, 1:], f[:, :-1])
        cache = DraftCache()
        parts = [head(e[:, 1:51], f[:, :50], cache), head(e[:, 51:52], f[:, 50:51], cache)]
        head(e[:, 52:81], torch.randn(1, 29, f.shape[-1]), cache)  # predictions, later dropped
        assert cache.get_seq_length() == 80 and cache.keys[0].shape[2] >= 80
        crop_to(cache, 51)
        parts += [head(e[:, 52:81], f[:, 51:80], cache), head(e[:, 81:], f[:, 80:-1], cache)]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)


def test_release_layout_round_trip(model, head, tmp_path):
    head.save(tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= keys
    assert not any("input_layernorm" in k or "embed" in k or "rotary" in k for k in keys)
    # An official release may come as pytorch_model.bin, with the target's embedding inside.
    official = tmp_path / "official"
    official.mkdir()
    (official / "config.json").write_text((tmp_path / "config.json").read_text())
    weights = dict(load_file(tmp_path / "model.safetensors"))
    weights["embed_tokens.weight"] = torch.zeros(V, model.config.hidden_size)
    torch.save(weights, official / "pytorch_model.bin")
    tokens = torch.tensor([[1, 2, 3, 4]])
    f, e = features_of(model, tokens), model.get_input_embeddings()(tokens)
    with torch.no_grad():
        expected = head(e[:, 1:], f[:, :-1])
        for folder in (tmp_path, official):
            assert torch.equal(load_head(folder, model)(e[:, 1:], f[:, :-1]), expected)
    # ours says in its metrics what length it trained on, which its drafter reads at most; a release reads it all
    (tmp_path / "metrics.json").write_text('{"kind": "eagle", "config": {"max_tokens": 384}}')
    assert load_any_head(tmp_path, model).window == 384 and load_any_head(official, model).window is None


def test_wrong_target_is_refused(head, tmp_path):
    head.save(tmp_path)
    with pytest.raises(ValueError, match="hidden size"):
        load_head(tmp_path, tiny_llama(vocab_size=V, hidden=64))
    with pytest.raises(ValueError, match="config.json"):
        load_head(tmp_path / "nothing", tiny_llama(vocab_size=V))


@pytest.mark.parametrize("method", ["sd", "fsd"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_match_a_recomputation_from_true_features(model, head, method, temperature):
    """At every step, the first draft's logits equal the head run from scratch on the target's
    true features of the accepted sequence: the head's cache keeps exactly what stays valid."""
    drafter = EagleDrafter(head, model, V)
    original = drafter.propose
    checked = []

    def checking(sequence, budget, sampling, generator):
        # (its logits kept even where the rule would not read them)
        draft = original(sequence, dataclasses.replace(budget, distributions=True), sampling, generator)
        assert torch.allclose(draft.logits[0], logits_from_scratch(model, head, sequence)[0], atol=1e-4)
        checked.append(len(draft))
        return draft

    drafter.propose = checking
    config = DecodeConfig(method=method, threshold=0.3, gamma=4, max_new_tokens=30, seed=0,
                          sampling=Sampling(temperature=temperature))
    tokens, stats = decode(model, drafter, torch.tensor([[5, 6, 7, 8]]), config, V)
    # The prompt's features come with its prefill, so every step drafts but a last one with room for one token.
    assert stats.target_forwards - 1 <= len(checked) <= stats.target_forwards
    assert sum(checked) == stats.proposed
    if method == "sd" and temperature == 0:
        assert tokens[0].tolist() == model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=30,
                                                    do_sample=False)[0, 4:].tolist()


def checked_from_its_offset(drafter, model, head, offsets):
    """``drafter``, its every first draft checked against the head run from scratch over the true features of the
    text from the drafter's offset on (a window's start: 0 while the text fits it), which go into ``offsets``; the
    true positions its cache holds then go into ``drafter.counts``."""
    original, drafter.counts = drafter.propose, []

    def checking(sequence, budget, sampling, generator):
        draft = original(sequence, dataclasses.replace(budget, distributions=True), sampling, generator)
        start = drafter.offset
        f = features_of(model, sequence[:, :-1])[:, start:]
        with torch.no_grad():
            e = model.get_input_embeddings()(sequence[:, start + 1:])
            expected = model.get_output_embeddings()(head(e, f)[:, -1])
        assert torch.allclose(draft.logits[0], expected[0], atol=1e-4)
        offsets.append(start)
        drafter.counts.append(drafter.true_positions)
        return draft

    drafter.propose = checking
    return drafter


def test_past_its_window_the_head_reads_the_texts_end_as_a_text_of_its_own(model, head, monkeypatch):
    """Past its ``window`` (the positions it trained on, read from the folder it was saved to) the head reads
    the text's last ones alone: its first draft at every step is what it computes over the true features of the
    text from its offset on, its cache never holds more of the text than the window, and greedy decoding is
    still the target's."""
    monkeypatch.setattr(head, "window", 12, raising=False)
    offsets = []
    drafter = checked_from_its_offset(EagleDrafter(head, model, V), model, head, offsets)
    prompt = torch.randint(0, V, (1, 20), generator=torch.Generator().manual_seed(4))
    config = DecodeConfig(method="sd", gamma=3, max_new_tokens=30)
    tokens, _ = decode(model, drafter, prompt, config, V)
    assert offsets[0] == 20 - 1 - 6 and len(set(offsets)) > 2  # the prompt's end, then later ends
    assert all(count - start <= 12 for start, count in zip(offsets, drafter.counts))  # never more than the window
    assert tokens[0].tolist() == model.generate(prompt, max_new_tokens=30, do_sample=False)[0, 20:].tolist()


@pytest.mark.parametrize("first_drafter", ["eagle", None])
def test_a_chats_next_turn_reads_the_features_its_window_needs(model, head, monkeypatch, first_drafter):
    """A slot that holds a chat's last turn spares its next turn's prompt what it holds. The head's features come
    from the slot where the last turn's drafter held them; else those it reads (its window's last half) are computed
    again. Either way it drafts from the true features."""
    monkeypatch.setattr(head, "window", 12, raising=False)
    step = TargetStep(model)
    config = DecodeConfig(method="sd", gamma=3, max_new_tokens=10, eos_token_ids=())
    first = torch.randint(0, V, (1, 25), generator=torch.Generator().manual_seed(5))
    first_config = config if first_drafter else DecodeConfig(method="ar", max_new_tokens=10, eos_token_ids=())
    answer, _ = decode(step, EagleDrafter(head, model, V) if first_drafter else None, first, first_config, V)
    follow = torch.cat([first, answer, torch.tensor([[2, 4, 6]])], 1)
    drafter = checked_from_its_offset(EagleDrafter(head, model, V), model, head, [])
    engine = Engine(step, V)
    row = engine.add(follow, config, drafter)
    while engine.rows:
        engine.step()
    length = follow.shape[1] - 1
    assert drafter.first_feature(length) == length - 6
    assert row.stats.cached_tokens == (25 + 10 - 1 if first_drafter else length - 6)
    assert row.tokens == model.generate(follow, max_new_tokens=10, do_sample=False)[0, follow.shape[1]:].tolist()


def test_features_held_from_a_later_position_are_not_lent_before_it(model, head, monkeypatch):
    """A turn whose drafter was given the features of its prompt's end only holds those: a next prompt that shares
    a start with it, but ends earlier, gets the features its window reads computed, never read from before them."""
    monkeypatch.setattr(head, "window", 12, raising=False)
    step = TargetStep(model)
    config = DecodeConfig(method="sd", gamma=3, max_new_tokens=10, eos_token_ids=())
    first = torch.randint(0, V, (1, 25), generator=torch.Generator().manual_seed(6))
    answer, _ = decode(step, None, first, DecodeConfig(method="ar", max_new_tokens=10, eos_token_ids=()), V)
    follow = torch.cat([first, answer, torch.tensor([[2, 4, 6]])], 1)  # 38 tokens: features from 31 on
    decode(step, EagleDrafter(head, model, V), follow, config, V)
    shorter = torch.cat([follow[:, :33], torch.tensor([[7, 7, 1]])], 1)  # its window reads from 29 on
    drafter = checked_from_its_offset(EagleDrafter(head, model, V), model, head, [])
    engine = Engine(step, V)
    row = engine.add(shorter, config, drafter)
    while engine.rows:
        engine.step()
    assert row.stats.cached_tokens == drafter.first_feature(35) == 29
    assert row.tokens == model.generate(shorter, max_new_tokens=10, do_sample=False)[0, 36:].tolist()


def tree_run(model, head, prompt, **options):
    config = DecodeConfig(tree=True, **options)
    return decode(model, EagleDrafter(head, model, V), torch.tensor([prompt]), config, V)


@pytest.mark.parametrize("shape", [dict(tree_total_tokens=8, tree_depth=3, tree_top_k=2),
                                   dict(tree_total_tokens=30, tree_depth=6, tree_top_k=5)])
def test_greedy_tree_decoding_is_the_targets_greedy_output(model, head, shape):
    prompt = [5, 6, 7, 8, 1]
    tokens, stats = tree_run(model, head, prompt, method="sd", max_new_tokens=40, **shape)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):]
    assert tokens[0].tolist() == expected.tolist()
    assert stats.target_forwards < 40  # the random head's trees still hit the target's argmax sometimes


def test_tree_thresholds(model, head):
    prompt = [2, 4, 6]
    ar, _ = tree_run(model, head, prompt, method="fsd", threshold=0.0, max_new_tokens=20, seed=1,
                     sampling=Sampling(temperature=1.0))
    plain = decode(model, None, torch.tensor([prompt]), DecodeConfig(method="ar", max_new_tokens=20, seed=1,
                                                                    sampling=Sampling(temperature=1.0)), V)[0]
    assert ar.tolist() == plain.tolist()  # T = 0: FSD accepts nothing and samples p at the root, as AR
    _, loose = tree_run(model, head, prompt, method="fsd", threshold=float("inf"), max_new_tokens=40,
                        tree_depth=4)
    # T = inf follows the tree to a leaf at every step: each step accepts at least one node.
    assert loose.accepted >= loose.target_forwards - 1 and loose.mean_accepted > 2
    for seed in range(3):
        exact = tree_run(model, head, prompt, method="sd", max_new_tokens=30, seed=seed,
                         sampling=Sampling(temperature=1.0))[0]
        hybrid = tree_run(model, head, prompt, method="fsd-hybrid", threshold=0.0, max_new_tokens=30, seed=seed,
                          sampling=Sampling(temperature=1.0))[0]
        assert exact.tolist() == hybrid.tolist()


def test_a_tree_narrowed_to_a_chain_between_trees_drafts_what_the_tree_would(model, head, monkeypatch):
    """Under the cost schedule a tree row may draft a chain one step and a tree the next: every draft's first
    distribution still equals the head run from scratch on the target's true features, a chain's tokens are the
    head's likeliest (the tree's own first path), and greedy sd stays the target's greedy output."""
    import fuzzyspec.core.engine as engine

    turns = iter([(3, 1), (3, 2), (2, 1), (4, 3)] * 20)
    monkeypatch.setattr(engine, "plan", lambda options, *rest, **kw: [next(turns) for _ in options])
    drafter = EagleDrafter(head, model, V)
    original, seen = drafter.propose, []

    def checking(sequence, budget, sampling, generator):
        draft = original(sequence, dataclasses.replace(budget, distributions=True), sampling, generator)
        expected = logits_from_scratch(model, head, sequence)
        assert torch.allclose(draft.logits[0], expected[0], atol=1e-4)
        if draft.is_chain:
            assert draft.tokens[0] == expected[0].argmax() and not draft.sampled
        seen.append(budget.tree[2] if budget.tree is not None else 1)
        return draft

    drafter.propose = checking
    prompt = [5, 6, 7, 8, 1]
    config = DecodeConfig(method="sd", tree=True, tree_top_k=3, gamma_schedule="cost", max_new_tokens=40,
                          sampling=Sampling(temperature=1.0), seed=0)
    decode(model, drafter, torch.tensor([prompt]), config, V)
    assert {1, 2, 3} <= set(seen)
    greedy = DecodeConfig(method="sd", tree=True, tree_top_k=3, gamma_schedule="cost", max_new_tokens=40)
    tokens, _ = decode(model, drafter, torch.tensor([prompt]), greedy, V)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):]
    assert tokens[0].tolist() == expected.tolist()


class Inline(Graphs):
    """Stands in for ``core.graphs.Graphs`` (a GPU's) on the CPU: runs the function a CUDA graph would capture, with
    the same arguments, and notes the keys it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[tuple] = []

    def __call__(self, key, function, arguments):
        self.keys.append(key)
        return function(*arguments), False


def test_a_tree_grown_as_one_captured_call_is_the_one_grown_level_by_level(model, head, monkeypatch):
    """Where the head's calls run through CUDA graphs, a tree's whole growth is one more (``HeadStep.trees``), its
    levels written where a tensor on the device says: it grows EAGLE-2's tree as the host did level by level, for
    every shape with levels below the root's children (the others, and sampling filters, grow as before), greedy
    and sampled, and counts its head passes."""
    step = EagleDrafter(head, model, V).step
    monkeypatch.setattr(step, "trees", Inline())
    generator = torch.Generator().manual_seed(5)

    def compiled_drafter():
        drafter = EagleDrafter(head, model, V)
        drafter.compiled = True
        return drafter

    for shape in TREE_SHAPES:
        for sampling in (Sampling(), Sampling(temperature=0.8)):
            prompt = torch.randint(0, V, (1, 12), generator=generator)
            captured = len(step.trees.keys)
            assert_grown_as_the_reference(compiled_drafter, prompt, features_of(model, prompt)[:, :-1], shape,
                                          sampling)
            assert len(step.trees.keys) == captured + (shape[1] > 1 and shape[2] > 1), shape
    drafter = compiled_drafter()
    drafter.reset()
    prompt = torch.randint(0, V, (1, 12), generator=generator)
    drafter.observe(0, features_of(model, prompt)[:, :-1])
    draft = drafter.propose(prompt, Budget(tokens=5, tree=(16, 5, 4), distributions=False), Sampling(), None)
    assert drafter.forwards == 1 + 4 and draft.q is None and draft.tokens.shape == (16,)


@pytest.mark.parametrize("reduced", [False, True])
def test_a_tree_grown_on_the_device_is_the_one_grown_level_by_level(model, head, reduced):
    """The tree grown on the device, read once, is EAGLE-2's tree as the host grew it a level at a time: the same
    tokens, parents and distributions, for shapes from one level or one child a node to wide and deep ones, greedy
    and under a sampling filter that leaves children of probability 0 (with a reduced draft vocabulary too)."""
    if reduced:
        head = copy.deepcopy(head)
        head.vocab = DraftVocab(torch.arange(0, V, 2), V)
    generator = torch.Generator().manual_seed(4)
    for shape in TREE_SHAPES:
        for sampling in (Sampling(), Sampling(temperature=0.8, top_k=3)):
            prompt = torch.randint(0, V, (1, 12), generator=generator)
            assert_grown_as_the_reference(lambda: EagleDrafter(head, model, V), prompt,
                                          features_of(model, prompt)[:, :-1], shape, sampling)
