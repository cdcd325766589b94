"""fuzzyspec.hf.generate as transformers' ``custom_generate`` hook, on tiny random Llamas."""
from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

import fuzzyspec.hf
from fuzzyspec.core.sampling import Sampling
from fuzzyspec.core.stats import Stats
from conftest import tiny_llama

V = 96
PROMPTS = [[1, 5, 9, 3, 7, 2], [4], [8, 8, 8, 1, 0, 30, 31, 2, 2, 6, 17]]


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_llama(vocab_size=V, layers=2, seed=0)


@pytest.fixture(scope="module")
def draft(target) -> LlamaForCausalLM:
    """One layer of its own (another seed) on the target's embeddings, final norm and head: agrees partly."""
    model = tiny_llama(vocab_size=V, layers=1, seed=1)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        model.model.norm.weight.copy_(target.model.norm.weight)
        model.lm_head.weight.copy_(target.lm_head.weight)
    return model


def ids(prompt: list[int]) -> torch.Tensor:
    return torch.tensor([prompt])


def fsd(model, prompt, **kwargs) -> torch.Tensor:
    return model.generate(ids(prompt), custom_generate=fuzzyspec.hf.generate, **kwargs)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("options", [dict(fsd_method="sd"), dict(fsd_method="sd", fsd_gamma=1),
                                     dict(fsd_method="ar"), dict(fsd_method="fsd-hybrid", fsd_threshold=0.0)])
def test_greedy_matches_hf_greedy(target, draft, prompt, options):
    expected = target.generate(ids(prompt), max_new_tokens=30, do_sample=False)
    out = fsd(target, prompt, draft_model=draft, max_new_tokens=30, do_sample=False, **options)
    assert out.tolist() == expected.tolist()


def test_greedy_sd_really_speculates(target, draft):
    stats: list[Stats] = []
    fsd(target, PROMPTS[0], draft_model=draft, fsd_method="sd", fsd_stats=stats, max_new_tokens=40)
    assert 0 < stats[0].accepted < stats[0].proposed  # the test above exercised accepts and rejects


def test_threshold_inf_is_the_drafts_greedy_output(target, draft):
    prompt = PROMPTS[2]
    expected = draft.generate(ids(prompt), max_new_tokens=25, do_sample=False)
    out = fsd(target, prompt, draft_model=draft, fsd_method="fsd", fsd_threshold=float("inf"),
              max_new_tokens=25, do_sample=False)
    assert out.tolist() == expected.tolist()


@pytest.mark.parametrize("method", ["fsd", "sd", "fsd-hybrid"])
def test_sampling_is_reproducible(target, draft, method):
    """A seed reproduces a sampled text where the draft sizes do not follow timings (README, "Guarantees and
    limits"): under the cost schedule they follow what each step was measured to cost, so a run can differ."""
    options = dict(draft_model=draft, fsd_method=method, fsd_threshold=0.3, max_new_tokens=30,
                   do_sample=True, temperature=1.5, top_k=0, fsd_gamma_schedule="constant")
    runs = [fsd(target, PROMPTS[0], fsd_seed=seed, **options).tolist() for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    # Without fsd_seed the seed comes from torch's global generator, as HF sampling does.
    torch.manual_seed(3)
    first = fsd(target, PROMPTS[0], **options).tolist()
    torch.manual_seed(3)
    assert fsd(target, PROMPTS[0], **options).tolist() == first


@pytest.mark.parametrize("n", [1, 2, 7, 13])
@pytest.mark.parametrize("method", ["sd", "fsd"])
@pytest.mark.parametrize("threshold", [0.3, float("inf")])
def test_max_new_tokens_respected(target, draft, n, method, threshold):
    prompt = PROMPTS[0]
    stats: list[Stats] = []
    out = fsd(target, prompt, draft_model=draft, fsd_method=method, fsd_threshold=threshold, fsd_gamma=5,
              fsd_stats=stats, max_new_tokens=n, do_sample=True, fsd_seed=0)
    assert out.shape == (1, len(prompt) + n)
    assert out[0, : len(prompt)].tolist() == prompt
    assert stats[0].new_tokens == n


def test_max_length_respected(target, draft):
    out = fsd(target, PROMPTS[0], draft_model=draft, max_length=10)
    assert out.shape == (1, 10)


def test_missing_draft_raises(target):
    for method in ("fsd", "sd", "fsd-hybrid"):
        with pytest.raises(ValueError, match="draft"):
            fsd(target, PROMPTS[0], fsd_method=method, max_new_tokens=5)
    with pytest.raises(ValueError, match="fsd_method must be one of"):
        fsd(target, PROMPTS[0], fsd_method="beam", max_new_tokens=5)
    assert fsd(target, PROMPTS[0], fsd_method="ar", max_new_tokens=5).shape == (1, len(PROMPTS[0]) + 5)


def test_stats_are_filled(target, draft):
    stats: list[Stats] = []
    out = fsd(target, PROMPTS[0], draft_model=draft, fsd_method="fsd", fsd_threshold=0.3, fsd_stats=stats,
              max_new_tokens=20, do_sample=True, temperature=0.6, top_p=0.9, fsd_seed=1)
    assert len(stats) == 1
    s = stats[0]
    assert isinstance(s, Stats) and s.method == "fsd"
    assert s.new_tokens == out.shape[1] - len(PROMPTS[0]) == 20
    assert s.target_forwards >= 1 and s.draft_forwards >= 1 and s.proposed >= 1
    assert s.divergence_quantiles() is not None


def test_eos_stops_like_hf(target, draft):
    prompt = PROMPTS[0]
    greedy = target.generate(ids(prompt), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
    eos = greedy[5]
    cut = greedy.index(eos) + 1  # kept, as HF keeps it
    for eos_token_id in (eos, [eos, V + 5]):
        expected = target.generate(ids(prompt), max_new_tokens=30, do_sample=False, eos_token_id=eos_token_id)
        out = fsd(target, prompt, draft_model=draft, fsd_method="sd", max_new_tokens=30, do_sample=False,
                  eos_token_id=eos_token_id)
        assert out.tolist() == expected.tolist()
        assert out[0, len(prompt):].tolist() == greedy[:cut]


class StopAtLength(StoppingCriteria):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_stopping_criteria_cut_inside_a_step(target, draft):
    # Threshold inf with gamma 5 adds 5 tokens a step: the criterion fires in the middle of the second.
    prompt = PROMPTS[0]
    stats: list[Stats] = []
    full = fsd(target, prompt, draft_model=draft, fsd_threshold=float("inf"), max_new_tokens=20, do_sample=False)
    out = fsd(target, prompt, draft_model=draft, fsd_threshold=float("inf"), fsd_gamma=5, max_new_tokens=20,
              do_sample=False, fsd_stats=stats,
              stopping_criteria=StoppingCriteriaList([StopAtLength(len(prompt) + 7)]))
    assert out.tolist() == full[:, : len(prompt) + 7].tolist()
    assert stats[0].new_tokens == 7


def test_direct_call_goes_through_hf(target, draft):
    via_hook = fsd(target, PROMPTS[1], draft_model=draft, fsd_method="sd", max_new_tokens=12, do_sample=False)
    direct = fuzzyspec.hf.generate(target, ids(PROMPTS[1]), draft_model=draft, fsd_method="sd",
                                   max_new_tokens=12, do_sample=False)
    assert direct.tolist() == via_hook.tolist()


def test_return_dict_in_generate(target, draft):
    out = fsd(target, PROMPTS[0], draft_model=draft, max_new_tokens=4, return_dict_in_generate=True)
    assert out.sequences.shape == (1, len(PROMPTS[0]) + 4)


def test_batch_and_padding_rejected(target, draft):
    with pytest.raises(ValueError, match="batch size 1"):
        target.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), custom_generate=fuzzyspec.hf.generate,
                        draft_model=draft, max_new_tokens=4)
    with pytest.raises(ValueError, match="attention_mask"):
        target.generate(torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[0, 1, 1]]),
                        custom_generate=fuzzyspec.hf.generate, draft_model=draft, max_new_tokens=4)
    # An all-ones mask is fine (HF drops it before calling the hook).
    out = target.generate(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                          custom_generate=fuzzyspec.hf.generate, draft_model=draft, max_new_tokens=4)
    assert out.shape == (1, 7)


def test_unsupported_processors_warn(target, draft):
    with pytest.warns(UserWarning, match="RepetitionPenaltyLogitsProcessor"):
        fsd(target, PROMPTS[0], draft_model=draft, max_new_tokens=4, repetition_penalty=1.3)


def test_sampling_from_generation_config():
    assert fuzzyspec.hf.sampling_from(GenerationConfig(do_sample=False, temperature=0.6, top_k=50)) == Sampling()
    assert fuzzyspec.hf.sampling_from(GenerationConfig(do_sample=True, temperature=0.6, top_k=50, top_p=0.9)) == \
        Sampling(temperature=0.6, top_k=50, top_p=0.9)
    assert fuzzyspec.hf.sampling_from(GenerationConfig(do_sample=True)) == Sampling(temperature=1.0)


def test_sampling_uses_hf_default_top_k(target, draft, monkeypatch):
    seen = []
    real = fuzzyspec.hf.sampling_from
    monkeypatch.setattr(fuzzyspec.hf, "sampling_from", lambda config: seen.append(real(config)) or seen[-1])
    fsd(target, PROMPTS[0], draft_model=draft, max_new_tokens=2, do_sample=True, temperature=0.6, top_p=0.9)
    assert seen == [Sampling(temperature=0.6, top_k=50, top_p=0.9)]


def test_drafters_by_name_and_every_option(target, tmp_path):
    """fsd_draft names any registry drafter; every decoding option is an fsd_ keyword (trees included)."""
    from fuzzyspec.drafters.eagle3 import make_eagle3
    from fuzzyspec.core.vocab import DraftVocab
    make_eagle3(target, DraftVocab(torch.arange(0, V, 2), V)).save(tmp_path)
    prompt = torch.tensor([PROMPTS[0] * 3])
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    for options in ({"fsd_draft": "lookup"}, {"fsd_draft": f"eagle:{tmp_path}"},
                    {"fsd_draft": f"eagle:{tmp_path}", "fsd_tree": True, "fsd_tree_depth": 3},
                    {"fsd_draft": "lookup", "fsd_gamma_schedule": "heuristic", "fsd_draft_confidence": 0.1}):
        stats = []
        out = target.generate(prompt, custom_generate=fuzzyspec.hf.generate, fsd_method="sd", fsd_stats=stats,
                              max_new_tokens=12, do_sample=False, **options)
        assert out.tolist() == expected.tolist() and stats[0].target_forwards >= 1
    with pytest.raises(TypeError, match="fsd_nonsense"):
        fuzzyspec.hf.generate(target, prompt, fsd_draft="lookup", fsd_nonsense=1, max_new_tokens=3)


@pytest.mark.parametrize("direct", [True, False])
def test_streamers_get_the_prompt_the_tokens_and_the_end(target, draft, direct):
    class Collect:
        def __init__(self):
            self.parts, self.ended = [], False

        def put(self, value):
            self.parts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    prompt = torch.tensor([PROMPTS[0]])
    if direct:  # called directly, the usual streamer= argument works
        out = fuzzyspec.hf.generate(target, prompt, draft_model=draft, fsd_method="sd", max_new_tokens=10,
                                    do_sample=False, streamer=streamer)
    else:  # through model.generate, transformers keeps streamer= to itself: fsd_streamer= it is
        out = target.generate(prompt, custom_generate=fuzzyspec.hf.generate, draft_model=draft, fsd_method="sd",
                              max_new_tokens=10, do_sample=False, fsd_streamer=streamer)
    assert streamer.ended and streamer.parts[0] == PROMPTS[0]
    assert sum(streamer.parts[1:], []) == out[0, len(PROMPTS[0]):].tolist()
