"""Our Llama modules (``core.llama``) compute what transformers' ``LlamaForCausalLM`` does, for the same weights."""
import json

import pytest
import torch
from transformers import AutoConfig, DynamicCache, LlamaConfig, LlamaForCausalLM

from fuzzyspec.core.llama import LlamaLikeConfig, LlamaLM
from fuzzyspec.drafters.eagle_head import EagleHead

FIELDS = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
              rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})


@pytest.fixture(scope="module")
def pair() -> tuple[LlamaForCausalLM, LlamaLM]:
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(LlamaConfig(**FIELDS, attn_implementation="sdpa")).eval()
    ours = LlamaLM(LlamaLikeConfig(**FIELDS)).eval()
    ours.load_state_dict(theirs.state_dict())  # strict: every name is transformers'
    return theirs, ours


@torch.no_grad()
def test_the_same_logits_and_hidden_states_as_transformers(pair):
    theirs, ours = pair
    ids = torch.randint(0, 64, (2, 9))
    expected, got = theirs(input_ids=ids, output_hidden_states=True), ours(input_ids=ids, output_hidden_states=True)
    assert torch.equal(got.logits, expected.logits)
    assert len(got.hidden_states) == len(expected.hidden_states) == 3  # each layer's input, then the normed output
    assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, expected.hidden_states))
    assert torch.equal(ours(input_ids=ids, logits_to_keep=2).logits, expected.logits[:, -2:])


@torch.no_grad()
def test_after_a_cache_and_with_padding_as_transformers(pair):
    theirs, ours = pair
    ids = torch.randint(0, 64, (2, 9))
    their_cache, our_cache = DynamicCache(), DynamicCache()
    theirs(input_ids=ids[:, :5], cache=their_cache, use_cache=True)
    ours(input_ids=ids[:, :5], cache=our_cache, use_cache=True)
    expected = theirs(input_ids=ids[:, 5:], cache=their_cache, use_cache=True).logits
    assert torch.equal(ours(input_ids=ids[:, 5:], cache=our_cache).logits, expected)
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[0, :3] = 0  # the first row left-padded by three
    expected = theirs(input_ids=ids, attention_mask=padding).logits
    got = ours(input_ids=ids, attention_mask=padding).logits
    assert torch.isfinite(got).all()  # a pad's row attends to itself, not to nothing
    assert torch.equal(got[0, 3:], expected[0, 3:]) and torch.equal(got[1], expected[1])


@torch.no_grad()
def test_an_eagle_head_on_our_layer_predicts_what_it_does_on_transformers(pair):
    """An EAGLE head built for our model takes our decoder layer; with the same weights it gives the features the
    head built for transformers' model gives, under a tree's mask and over a cache."""
    theirs, ours = pair
    head_theirs, head_ours = EagleHead.for_target(theirs), EagleHead.for_target(ours)
    assert type(head_ours.layers[0]).__module__ == "fuzzyspec.core.llama"
    head_ours.load_state_dict(head_theirs.state_dict())
    embeds, features = torch.randn(1, 4, 64), torch.randn(1, 4, 64)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)[None, None]
    positions = torch.tensor([[0, 1, 1, 2]])
    caches = DynamicCache(), DynamicCache()
    first = [head(embeds, features, cache, mask, positions) for head, cache in zip((head_theirs, head_ours), caches)]
    assert torch.allclose(first[0], first[1], atol=1e-6)
    after = [head(embeds[:, :2], features[:, :2], cache) for head, cache in zip((head_theirs, head_ours), caches)]
    assert torch.allclose(after[0], after[1], atol=1e-6)


def test_a_saved_config_reads_back_as_transformers_llama_config(tmp_path):
    config = LlamaLikeConfig(**FIELDS)
    assert config._attn_implementation == "sdpa" and config.head_dim == 16
    config.to_json_file(tmp_path / "config.json")
    again = AutoConfig.for_model(**json.loads((tmp_path / "config.json").read_text()))
    assert isinstance(again, LlamaConfig)
    assert all(getattr(again, key) == value for key, value in FIELDS.items())


def test_a_config_json_transformers_wrote_reads_into_ours(tmp_path):
    """An EAGLE head's config.json as transformers writes it makes our config (``draftlm.config_like``): its fields,
    those ours does not name kept as they are; older rope fields read as rope parameters, whose type Rotary checks."""
    from fuzzyspec.core.llama import Rotary
    from fuzzyspec.drafters.draftlm import config_like

    LlamaConfig(**FIELDS, bias=False).to_json_file(tmp_path / "config.json")
    ours = config_like(json.loads((tmp_path / "config.json").read_text()), LlamaLikeConfig(**FIELDS))
    assert type(ours) is LlamaLikeConfig and all(getattr(ours, key) == value for key, value in FIELDS.items())
    assert ours.bias is False and ours.transformers_version
    fields = {key: value for key, value in FIELDS.items() if key != "rope_parameters"}
    assert LlamaLikeConfig(**fields, rope_theta=500.0).rope_parameters == {"rope_type": "default", "rope_theta": 500.0}
    scaled = LlamaLikeConfig(**fields, rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="rope type 'linear' is not implemented"):
        Rotary(scaled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_angles_are_transformers_bit_for_bit(dtype):
    """Our rotary embedding gives transformers' cos and sin exactly, at small and large positions, in the input's
    dtype (the logits tests above cover it only through a whole model, at small positions, in float32)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from fuzzyspec.core.llama import TABLE_LIMIT, Rotary

    theirs, ours = LlamaRotaryEmbedding(LlamaConfig(**FIELDS)), Rotary(LlamaLikeConfig(**FIELDS))
    x = torch.zeros(2, 5, FIELDS["hidden_size"], dtype=dtype)
    for positions in (torch.arange(10).reshape(2, 5), torch.randint(0, 60_000, (2, 5)),
                      torch.randint(0, 200_000, (2, 5)), torch.tensor([[-3, 0, 1, 2, 70_000]] * 2)):
        expected, got = theirs(x, positions), ours(x, positions)
        assert all(a.dtype == b.dtype == dtype and torch.equal(a, b) for a, b in zip(got, expected))
        # a step's: read from a table of the positions so far, grown as they come (past its limit, or below 0,
        # computed), contiguous as the kernels read them
        with torch.inference_mode():
            assert all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(ours(x, positions), expected))
    assert 256 < ours._tables[dtype].shape[1] <= TABLE_LIMIT  # (grown from its first 256 positions, no further)
