import dataclasses
import json

import pytest
import torch

from conftest import noisy_copy, tiny_llama
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.engine import decode
from fuzzyspec.core.kvcache import DraftCache
from fuzzyspec.drafters.draftlm import make_draft_lm
from fuzzyspec.drafters.model import ModelDrafter
from fuzzyspec.drafters.eagle import EagleDrafter, load_any_head
from fuzzyspec.drafters.eagle3 import default_feature_layers, is_eagle3, load_eagle3, make_eagle3
from fuzzyspec.core.sampling import Sampling
from fuzzyspec.core.vocab import DraftVocab
from stats_util import two_token_check
from tree_reference import TREE_SHAPES, assert_grown_as_the_reference

V = 32


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(vocab_size=V, layers=6, seed=7)


def random_head(target, vocab=None, train_lm_head=False, seed=0):
    torch.manual_seed(seed)
    head = make_eagle3(target, vocab or DraftVocab(torch.arange(0, V, 2), V), train_lm_head=train_lm_head)
    with torch.no_grad():  # a random head whose outputs are far from zero
        for name, weight in head.named_parameters():
            if "norm" not in name and weight.requires_grad:
                weight.normal_(0, 0.3)
    return head.eval()


def test_default_feature_layers():
    assert default_feature_layers(30) == [2, 15, 27]
    assert default_feature_layers(6) == [2, 3]


def test_unrolled_training_matches_what_drafting_computes(target_model):
    """Training-time test: step s of ``unroll`` at index j is exactly the head run s tokens past the last
    true feature with a KV cache, as the drafter runs it."""
    head = random_head(target_model)
    tokens = torch.tensor([[3, 9, 1, 14, 7, 7, 22, 5, 30, 2]])
    with torch.no_grad():
        hidden = target_model(tokens, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in head.feature_layers], -1)
        embeds = target_model.get_input_embeddings()(tokens[:, 1:])
        outputs = head.unroll(embeds, features[:, :-1], steps=3)
        for j in (0, 3, 5):
            cache = DraftCache()
            out = head(embeds[:, : j + 1], features[:, : j + 1], cache)[:, -1:]
            torch.testing.assert_close(out[0, 0], outputs[0][0, j], rtol=1e-4, atol=1e-4)
            for step in (1, 2):
                out = head(embeds[:, j + step: j + step + 1], out, cache)
                torch.testing.assert_close(out[0, 0], outputs[step][0, j], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("train_lm_head", [False, True])
def test_save_and_load_in_the_release_layout(tmp_path, target_model, train_lm_head):
    head = random_head(target_model, train_lm_head=train_lm_head)
    head.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == V // 2
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == head.feature_layers
    assert is_eagle3(tmp_path)
    from safetensors.torch import load_file
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == train_lm_head and {"d2t", "t2d", "fc.weight"} <= set(stored)
    loaded = load_any_head(tmp_path, target_model)
    assert loaded.vocab.target_ids.tolist() == list(range(0, V, 2))
    embeds, features = torch.randn(1, 4, 32), torch.randn(1, 4, 32 * len(head.feature_layers))
    with torch.no_grad():
        expected = head.logits(head(embeds, features))
        torch.testing.assert_close(loaded.float().logits(loaded.float()(embeds, features)), expected,
                                   rtol=0.05, atol=0.05)  # stored in bfloat16


def test_foreign_heads_are_refused(tmp_path, target_model):
    random_head(target_model).save(tmp_path)
    other = tiny_llama(vocab_size=V, layers=6, seed=1, hidden=16)
    with pytest.raises(ValueError, match="another target"):
        load_eagle3(tmp_path, other)


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_sd_with_a_reduced_vocabulary_head_is_the_targets_output(target_model, tree):
    head = random_head(target_model)
    drafter = EagleDrafter(head, target_model, V)
    prompt = torch.tensor([[1, 4, 7, 10, 14, 17]])
    config = DecodeConfig(method="sd", max_new_tokens=20, tree=tree)
    tokens, stats = decode(target_model, drafter, prompt, config, V)
    expected = target_model.generate(prompt, max_new_tokens=20, do_sample=False)[0, 6:]
    assert tokens[0].tolist() == expected.tolist()
    assert stats.proposed > 0
    # Drafts only ever come from the draft vocabulary.
    for method in ("fsd", "fsd-hybrid"):
        tokens, _ = decode(target_model, drafter, prompt, DecodeConfig(method=method, threshold=float("inf"),
                                                                       max_new_tokens=12, tree=tree), V)
        assert tokens.shape[1] == 12


@pytest.mark.parametrize("top_k, children", [(0, 2), (3, 4)])
def test_sampled_sd_on_eagle_trees_has_the_targets_distribution(top_k, children):
    """EAGLE-2 trees under sampled sd (every row's test decided on the device, the path followed after one
    read): the joint distribution of two sampled tokens is the target's own (chi-square over 1,500 runs); and so
    under a top-k filter narrower than the tree, where each node's last child has probability 0 and is left out
    (the tree reads how many nodes are left): the target's filtered distribution."""
    target = tiny_llama(vocab_size=6, layers=4, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.1)  # flatter distributions: every cell gets counts
    torch.manual_seed(0)
    head = make_eagle3(target, DraftVocab(torch.arange(6), 6)).eval()
    drafter = EagleDrafter(head, target, 6)
    sampling = Sampling(temperature=1.0, top_k=top_k)
    config = DecodeConfig(method="sd", tree=True, tree_depth=2, tree_top_k=children, tree_total_tokens=4,
                          max_new_tokens=2, sampling=sampling)
    prompt = torch.tensor([[1, 2, 3]])
    p_value, accepted = two_token_check(
        target, prompt, lambda seed: decode(target, drafter, prompt, dataclasses.replace(config, seed=seed), 6),
        sampling=sampling)
    assert 100 < accepted < 1400
    assert p_value > 1e-3


@pytest.mark.parametrize("seed", range(3))
def test_hybrid_at_zero_is_sd_on_sampled_trees(target_model, seed):
    """fsd-hybrid at T = 0 on EAGLE-2 trees: the same text as sd under one seed (the same random numbers)."""
    drafter = EagleDrafter(random_head(target_model), target_model, V)
    prompt = torch.tensor([[1, 4, 7, 10, 14, 17]])
    common = dict(tree=True, max_new_tokens=24, sampling=Sampling(temperature=1.0), seed=seed)
    sd, sd_stats = decode(target_model, drafter, prompt, DecodeConfig(method="sd", **common), V)
    hybrid, hybrid_stats = decode(target_model, drafter, prompt,
                                  DecodeConfig(method="fsd-hybrid", threshold=0.0, **common), V)
    assert sd.tolist() == hybrid.tolist() and sd_stats.accepted == hybrid_stats.accepted


def test_sampled_sd_with_a_reduced_draft_vocabulary_has_the_targets_distribution():
    """The draft can propose only tokens 0, 2 and 4 of 6, so q is zero where p is not: SD must still emit
    the target's own joint distribution of two tokens (chi-square over 1,500 seeded runs)."""
    target = tiny_llama(vocab_size=6, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.1)
    noisy = noisy_copy(target, 0.8, seed=4)
    draft = make_draft_lm(noisy, 1, vocab=DraftVocab(torch.tensor([0, 2, 4]), 6))
    draft.model.get_output_embeddings().weight.data.copy_(noisy.lm_head.weight.data[[0, 2, 4]])
    drafter = ModelDrafter(draft.model, 6, draft.vocab)
    assert drafter.vocab is not None
    config = DecodeConfig(method="sd", gamma=3, max_new_tokens=2, sampling=Sampling(temperature=1.0))
    prompt = torch.tensor([[1, 2, 3]])
    p_value, accepted = two_token_check(
        target, prompt, lambda seed: decode(target, drafter, prompt, dataclasses.replace(config, seed=seed), 6))
    assert 100 < accepted < 1400
    assert p_value > 1e-3


def test_an_eagle3_tree_grown_on_the_device_is_the_one_grown_level_by_level(target_model):
    """As for an EAGLE-1/2 head (tests/drafters/test_eagle.py): an EAGLE-3 head's tree (its own module's step, which
    sees a tree level's mask as the drafter made it on the device) is the one grown level by level."""
    head = random_head(target_model)
    generator = torch.Generator().manual_seed(5)
    width = len(head.feature_layers) * target_model.config.hidden_size
    for shape in TREE_SHAPES:
        for sampling in (Sampling(), Sampling(temperature=0.8, top_k=3)):
            prompt = torch.randint(0, V, (1, 10), generator=generator)
            features = torch.randn(1, 9, width, generator=generator)
            assert_grown_as_the_reference(lambda: EagleDrafter(head, target_model, V), prompt, features, shape,
                                          sampling)
