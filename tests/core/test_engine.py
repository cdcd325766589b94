import copy
import dataclasses
import math

import pytest
import torch
from transformers import DynamicCache

from conftest import noisy_copy, tiny_llama
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core import engine as engine_module
from fuzzyspec.core.cost import MEMORY, Profile, draft_key
from fuzzyspec.core.engine import Engine, Job, decode
from fuzzyspec.core.divergences import divergence
from fuzzyspec.core.draft import Budget
from fuzzyspec.drafters.lookup import CopyFirst
from fuzzyspec.drafters.model import ModelDrafter
from fuzzyspec.core.kvcache import crop_to
from fuzzyspec.core.rules import RULES
from fuzzyspec.core.sampling import Sampling
from fuzzyspec.core.step import TargetStep
from stats_util import two_token_check

V = 32
PROMPTS = [[1, 5, 9, 3, 7, 2], [4], [8, 8, 8, 1, 0, 30, 31, 2, 2, 6, 17]]


def run(target, draft, prompt, **options):
    sampling = Sampling(**{k: options.pop(k) for k in ("temperature", "top_k", "top_p") if k in options})
    config = DecodeConfig(sampling=sampling, **options)
    vocab = target.config.vocab_size
    drafter = ModelDrafter(draft, vocab) if draft is not None else None
    tokens, stats = decode(target, drafter, torch.as_tensor(prompt).view(1, -1), config, vocab)
    return tokens[0].tolist(), stats


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("options", [dict(gamma=1), dict(gamma=4), dict(gamma=7),
                                     dict(gamma=3, gamma_schedule="heuristic"),
                                     dict(gamma=5, draft_confidence=0.4)])
def test_greedy_sd_is_the_targets_greedy_output(target, draft, prompt, options):
    expected = hf_greedy(target, prompt, 40)
    tokens, stats = run(target, draft, prompt, method="sd", max_new_tokens=40, **options)
    assert tokens == expected
    assert stats.accepted > 0 and stats.accepted < stats.proposed  # both paths taken


def test_greedy_ar_is_the_targets_greedy_output(target, prompt):
    tokens, stats = run(target, None, prompt.tolist()[0], method="ar", max_new_tokens=30)
    assert tokens == hf_greedy(target, prompt.tolist()[0], 30)
    assert stats.target_forwards == 30 and stats.mean_accepted == 1.0 and stats.proposed == 0


@pytest.mark.parametrize("greedy_drafts,compiled", [(False, False), (True, False), (False, True)])
def test_sampled_sd_has_the_targets_distribution(greedy_drafts, compiled):
    """Two sampled tokens per run, 1,500 runs: the joint distribution of (t1, t2) must be
    the target's own p(t1) p(t2 | t1) (chi-square), although the draft differs; also when the
    draft proposes its argmax while the target samples (the reference code's drafting), and through
    compiled target steps (padded to the compiled widths)."""
    target = tiny_llama(vocab_size=6, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.1)  # flatter distributions: every cell gets counts
    draft = noisy_copy(target, 0.8, seed=4)
    config = DecodeConfig(method="sd", gamma=3, max_new_tokens=2, sampling=Sampling(temperature=1.0),
                          greedy_drafts=greedy_drafts)
    drafter = ModelDrafter(draft, 6)
    step = TargetStep(target, compile=compiled, widths=(1, 6))
    prompt = torch.tensor([[1, 2, 3]])
    p_value, accepted = two_token_check(
        target, prompt, lambda seed: decode(step, drafter, prompt, dataclasses.replace(config, seed=seed), 6))
    assert 100 < accepted < 1400  # the draft is neither always right nor always wrong
    assert p_value > 1e-3


def test_greedy_drafts_are_the_drafts_argmax_while_sampling(target, draft):
    sampling = Sampling(temperature=1.0)
    sequence = torch.tensor([PROMPTS[2]])
    argmax = ModelDrafter(draft, V).propose(sequence, Budget(4), Sampling(), None).tokens
    for seed in range(5):
        drafted = ModelDrafter(draft, V).propose(sequence, Budget(4, greedy=True), sampling,
                                                 torch.Generator().manual_seed(seed))
        assert drafted.tokens.tolist() == argmax.tolist() and not drafted.sampled
    sampled = {tuple(ModelDrafter(draft, V).propose(sequence, Budget(4), sampling,
                                                    torch.Generator().manual_seed(seed)).tokens.tolist())
               for seed in range(5)}
    assert len(sampled) > 1


@pytest.mark.parametrize("seed", range(4))
def test_hybrid_at_zero_equals_sd(target, draft, seed):
    common = dict(max_new_tokens=40, gamma=4, temperature=1.0, top_k=20, seed=seed, divergence="kl_pq")
    sd_tokens, sd_stats = run(target, draft, PROMPTS[0], method="sd", **common)
    hy_tokens, hy_stats = run(target, draft, PROMPTS[0], method="fsd-hybrid", threshold=0.0, **common)
    assert sd_tokens == hy_tokens
    assert sd_stats.accepted == hy_stats.accepted


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fsd_at_infinity_is_draft_only_decoding(target, draft, temperature):
    fuzzy, stats = run(target, draft, PROMPTS[0], method="fsd", threshold=math.inf, temperature=temperature,
                       seed=7, max_new_tokens=33)
    alone, _ = run(draft, None, PROMPTS[0], method="ar", temperature=temperature, seed=7, max_new_tokens=33)
    assert fuzzy == alone
    assert stats.target_forwards == 0 and stats.acceptance_rate == 1.0


def test_fsd_acceptance_grows_with_threshold(target, draft):
    _, probe = run(target, draft, PROMPTS[2], method="fsd", divergence="js", threshold=0.0, max_new_tokens=40)
    rates = []
    for threshold in [0.0, probe.divergence_quantiles()["q50"], math.inf]:
        _, stats = run(target, draft, PROMPTS[2], method="fsd", divergence="js", threshold=threshold,
                       max_new_tokens=40)
        rates.append(stats.acceptance_rate)
    assert rates[0] == 0.0  # D = 0 needs identical distributions
    assert rates[0] < rates[1] < rates[2] == 1.0


def reference_decode(target, draft, prompt, method, config):
    """The same algorithm with no KV caches at all: every forward recomputes the whole sequence."""
    sampling, g = config.sampling, torch.Generator().manual_seed(config.seed)
    sequence = torch.tensor([prompt])
    with torch.no_grad():
        while (remaining := config.max_new_tokens - (sequence.shape[1] - len(prompt))) > 0:
            context, drafts, q = sequence, [], []
            for _ in range(min(config.gamma, remaining - 1)):
                logits = draft(context).logits[:, -1]
                probs = sampling.probs(logits)
                token = sampling.pick(logits, probs, g).view(1, 1)
                drafts.append(token), q.append(probs)
                context = torch.cat([context, token], 1)
            k = len(drafts)
            drafts = torch.cat(drafts, 1) if drafts else torch.empty(1, 0, dtype=torch.long)
            q = torch.stack(q, 1) if k else torch.empty(1, 0, V)
            p = sampling.probs(target(torch.cat([sequence, drafts], 1)).logits[:, -(k + 1):])
            d = divergence(p[:, :k], q, config.divergence)
            accepted, nxt = RULES[method](drafts, p, q, d, config.threshold, sampling.greedy, g)
            n = int(accepted)
            sequence = torch.cat([sequence, drafts[:, :n], nxt.view(1, 1)], 1)[:, : len(prompt) + config.max_new_tokens]
    return sequence[0, len(prompt):].tolist()


@pytest.mark.parametrize("method", ["sd", "fsd", "fsd-hybrid"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_rollback_equals_recomputation(target, draft, method, temperature):
    config = DecodeConfig(method=method, gamma=4, threshold=0.12, seed=3, max_new_tokens=36,
                          sampling=Sampling(temperature=temperature))
    tokens, stats = decode(target, ModelDrafter(draft, V), torch.tensor([PROMPTS[0]]), config, V)
    assert 0 < stats.accepted < stats.proposed
    assert tokens[0].tolist() == reference_decode(target, draft, PROMPTS[0], method, config)


def test_cropped_cache_matches_a_fresh_forward(target):
    sequence = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    with torch.no_grad():
        cache = DynamicCache()
        target(sequence[:, :6], past_key_values=cache, use_cache=True)
        target(torch.tensor([[7, 7, 7]]), past_key_values=cache, use_cache=True)  # rejected drafts
        crop_to(cache, 6)
        assert cache.get_seq_length() == 6
        cached = target(sequence[:, 6:], past_key_values=cache, use_cache=True).logits
        fresh = target(sequence).logits[:, 6:]
    assert torch.allclose(cached, fresh, atol=1e-5)


def test_eos_inside_accepted_drafts_ends_generation(target):
    free, _ = run(target, target, PROMPTS[0], method="sd", max_new_tokens=30)
    eos = free[10]
    first = free.index(eos)
    tokens, stats = run(target, target, PROMPTS[0], method="sd", gamma=8, max_new_tokens=30, eos_token_ids=(eos,))
    assert tokens == free[: first + 1]
    assert stats.acceptance_rate == 1.0  # the draft is the target: EOS arrived inside accepted drafts


@pytest.mark.parametrize("n", [1, 2, 7, 13])
def test_max_new_tokens_is_exact(target, draft, n):
    tokens, stats = run(target, draft, PROMPTS[0], method="fsd", threshold=0.5, gamma=5, max_new_tokens=n)
    assert len(tokens) == n == stats.new_tokens


def test_statistics_add_up(target, draft):
    tokens, stats = run(target, draft, PROMPTS[2], method="fsd", threshold=0.4, gamma=4, max_new_tokens=50)
    assert stats.new_tokens == len(tokens) == 50
    assert stats.accepted + stats.target_forwards >= stats.new_tokens  # the last step may be cut short
    assert stats.mean_accepted == pytest.approx(50 / stats.target_forwards)
    assert stats.proposed == sum(1 for _ in range(stats.proposed))
    assert len(stats.position_acceptance) == 4 and all(0 <= a <= 1 for a in stats.position_acceptance)
    assert stats.position_acceptance[0] == pytest.approx(stats.accepted_at[0] / stats.reached_at[0])
    assert stats.reached_at[0] == stats.target_forwards - sum(1 for _ in [])  or stats.reached_at[0] > 0
    quantiles = stats.divergence_quantiles()
    assert quantiles["q10"] <= quantiles["q50"] <= quantiles["q90"]
    assert stats.draft_forwards >= stats.proposed and stats.wall_s > 0 and stats.tokens_per_s > 0


def test_raw_divergence_ignores_processing(target, draft):
    hot = dict(method="fsd", threshold=0.2, temperature=3.0, seed=1, max_new_tokens=30)
    _, processed = run(target, draft, PROMPTS[0], **hot)
    _, raw = run(target, draft, PROMPTS[0], raw_divergence=True, **hot)
    assert processed.divergence_quantiles() != raw.divergence_quantiles()


@pytest.mark.parametrize("bad", [dict(gamma=0), dict(threshold=-0.1), dict(threshold=float("nan")),
                                 dict(max_new_tokens=0), dict(divergence="cosine"), dict(method="beam"),
                                 dict(draft_confidence=1.5), dict(gamma_schedule="fast")])
def test_bad_config_is_rejected(bad):
    with pytest.raises(ValueError):
        DecodeConfig(**bad)


def test_answers_one_after_another_reuse_the_steps_cache(target, draft):
    """An engine gives its cache back when its last row finishes, and the next engine on the same step takes it
    (emptied) where it needs that shape: CUDA graphs are captured over the cache's tensors, so a new cache for
    every answer would capture them anew. Two engines at once never share one."""
    step = TargetStep(target)
    config = DecodeConfig(method="sd", gamma=3, max_new_tokens=20)
    prompt = torch.tensor([PROMPTS[0]])
    first, _ = decode(step, ModelDrafter(draft, V), prompt, config, V)
    lent = step.borrow_cache(1, 256)
    step.give_back(lent)
    again, _ = decode(step, ModelDrafter(draft, V), prompt, config, V)
    assert again.tolist() == first.tolist() == [run(target, draft, PROMPTS[0], method="sd", gamma=3,
                                                    max_new_tokens=20)[0]]
    assert step.borrow_cache(1, 256) is lent and lent.lengths == [0]  # given back again by the second answer
    held = len(lent.held[0].tokens)  # emptied for the next but for what its slot holds (the last answer's text)
    text = torch.tensor(PROMPTS[0] + first[0].tolist())
    assert held == len(text) - 1 and torch.equal(lent.held[0].tokens, text[:-1])
    assert all(not bool(tensor[:, :, held:].any()) for tensor in (*lent.keys, *lent.values))
    assert step.borrow_cache(1, 256) is not lent  # lent out already: another engine gets its own
    step.give_back(lent)
    assert step.borrow_cache(1, 512) is not lent  # another shape: a new cache, as before


@pytest.mark.parametrize("first_length", [30, 240])  # (the second answer's cache: the same one, or a larger one)
@pytest.mark.parametrize("method", ["ar", "sd"])
def test_a_prompt_that_begins_with_a_free_slots_text_is_computed_from_where_it_differs(target, draft, first_length,
                                                                                       method):
    """A chat's next turn begins with the last turn's prompt and answer: the slot the last answer left holds their
    keys and values, so the new prompt is computed from where it differs, and decodes as it would from scratch.
    A prompt that differs from the start is computed whole."""
    step = TargetStep(target)
    config = DecodeConfig(method=method, gamma=3, max_new_tokens=12, eos_token_ids=())
    first = torch.randint(0, V, (1, first_length), generator=torch.Generator().manual_seed(1))
    drafter = (lambda: ModelDrafter(draft, V)) if method == "sd" else (lambda: None)
    answer, _ = decode(step, drafter(), first, config, V)
    follow = torch.cat([first, answer, torch.tensor([[3, 9, 27, 1, 30]])], 1)
    widths = []
    forward = step.forward
    step.forward = lambda cache, tokens, *rest: widths.append(tokens.shape[1]) or forward(cache, tokens, *rest)
    engine = Engine(step, V)
    row = engine.add(follow, config, drafter())
    while engine.rows:
        engine.step()
    held = first_length + 12 - 1  # the first answer's newest token never reached the cache
    assert row.stats.cached_tokens == held and widths[0] == follow.shape[1] - 1 - held
    fresh, _ = decode(TargetStep(target), drafter(), follow, config, V)
    assert row.tokens == fresh[0].tolist()
    other = torch.randint(0, V, (1, 20), generator=torch.Generator().manual_seed(2))
    row = engine.add(other, config, drafter())
    while engine.rows:
        engine.step()
    assert row.stats.cached_tokens == 0 and row.tokens == decode(TargetStep(target), drafter(), other, config,
                                                                 V)[0][0].tolist()


class CopySpy(CopyFirst):
    """CopyFirst that keeps its last draft, so a test can tell a copy's step."""

    def propose(self, *arguments):
        self.last = super().propose(*arguments)
        return self.last


@pytest.mark.parametrize("prompt", PROMPTS + [[3, 7, 2, 5, 3, 7, 2, 9, 3, 7, 2]])
def test_copied_drafts_keep_greedy_sd_exact_and_stay_out_of_the_plan(target, draft, prompt):
    """The default job copies from the text where it can (``CopyFirst``): the text is still the target's, and a
    copy's step changes neither the row's acceptance nor the drafter's measured prices, which size the drafter's
    own drafts."""
    step = TargetStep(target)
    engine = Engine(step, V)
    drafter = CopySpy(ModelDrafter(draft, V))
    config = DecodeConfig(method="sd", gamma=4, gamma_schedule="cost", max_new_tokens=40)
    row = engine.add(torch.tensor([prompt]), config, drafter)
    copies = planned = 0
    while engine.rows:
        drafter.last = None
        acceptance, prices = copy.deepcopy(vars(row.acceptance)), copy.deepcopy(step.profile.draft)
        copied_before = sum(row.copies.reached.get(1, []))
        engine.step()
        if drafter.last is not None and not drafter.last.planned:
            copies += 1
            assert vars(row.acceptance) == acceptance and step.profile.draft == prices
            assert sum(row.copies.reached.get(1, [])) > copied_before * MEMORY  # the copies' own, instead
            assert len(drafter.last) <= row.copy
        elif drafter.last is not None:
            planned += 1
    assert row.sequence[0, len(prompt):].tolist() == hf_greedy(target, prompt, 40)
    assert planned > 0 and (copies > 0 or len(prompt) < 11)


def test_copies_are_as_long_as_the_measured_widths_pay_for(target, draft):
    """Where verifying more than two tokens is dear, the text's copies hold one token; where it is as cheap as one,
    they run to --gamma. The text is the target's either way."""
    prompt = [3, 7, 2, 5, 3, 7, 2, 9, 3, 7, 2] * 2
    lengths = {}
    for name, costs in (("dear", {1: 1.0, 2: 1.1, 3: 1e4}), ("cheap", {w: 1.0 for w in range(1, 8)})):
        step = TargetStep(target)
        step.profile = Profile(target=costs, outside={1: 0.1})
        engine = Engine(step, V)
        drafter = CopySpy(ModelDrafter(draft, V))
        row = engine.add(torch.tensor([prompt]), DecodeConfig(method="sd", gamma=4, gamma_schedule="cost",
                                                              max_new_tokens=30), drafter)
        lengths[name] = set()
        while engine.rows:
            drafter.last = None
            engine.step()
            if drafter.last is not None and not drafter.last.planned:
                lengths[name].add(len(drafter.last))
        assert row.sequence[0, len(prompt):].tolist() == hf_greedy(target, prompt, 30)
    assert lengths["dear"] == {1} and 4 in lengths["cheap"]


@pytest.mark.parametrize("refresh", [(2, 1), (10**6, 0)])
def test_a_narrow_pass_priced_too_high_is_measured_again(target, draft, monkeypatch, refresh):
    """Now and then (``REFRESH``) a plan drafts a 1-token chain where it planned more, and measures that pass afresh. A
    profile holding every width's pass at one price (as a slow spell left one: 1-4 token passes at twice their cost
    beside a 5-token one at its own) drafts 4-token chains at every step and, running only those, never corrects
    the 2-token price; with the refresh it learns what a 2-token pass costs and drafts 1-token chains, which pay
    here. Passes are timed by a stand-in for the clock: w tokens cost 10 w ms."""
    monkeypatch.setattr(engine_module, "REFRESH", refresh[0])
    monkeypatch.setattr(engine_module, "REFRESH_AT", refresh[1])
    took = Engine._forward_took
    monkeypatch.setattr(Engine, "_forward_took", lambda self, width, rows, ms, context:
                        took(self, width, rows, 10.0 * width, context))
    monkeypatch.setattr(Engine, "_price", lambda *args: None)  # (drafting and outside keep the prices given here)
    drafter = ModelDrafter(draft, V)
    step = TargetStep(target)
    step.profile = Profile(target={width: 100.0 for width in range(1, 18)}, outside={1: 1.0},
                           draft={draft_key(drafter.name, 1): {size: float(size) for size in range(1, 5)}})
    engine = Engine(step, V)
    row = engine.add(torch.tensor([PROMPTS[0]]), DecodeConfig(method="sd", gamma=4, gamma_schedule="cost",
                                                              max_new_tokens=120), drafter)
    planned = []
    while engine.rows:
        engine.step()
        planned.append((row.size, row.breadth))
    two, five = step.profile.target_ms(2), step.profile.target_ms(5)
    assert row.sequence[0, len(PROMPTS[0]):].tolist() == hf_greedy(target, PROMPTS[0], 120)
    if refresh[0] == 2:
        assert two < 0.5 * five and set(planned[20:-4]) == {(1, 1)}  # (the last plans are capped by the tokens left)
    else:  # (without it: the flat prices stay, and so do the 4-token chains)
        assert two == five and (1, 1) not in planned


def test_plans_come_less_often_while_every_row_is_held_back(target, draft, monkeypatch):
    """While the cost schedule holds every row back, each plan comes twice as many steps after the last, up to
    ``HELD_PLAN_EVERY``; once one drafts, plans come every ``PLAN_EVERY`` steps again. The first plan, made before any
    pass is priced, is not doubled: it held the row back only for want of a price. The text is AR's throughout."""
    sizes = iter([0] * 5 + [2] * 1000)  # five plans holding the row back, then 2-token chains
    monkeypatch.setattr(engine_module, "plan", lambda options, *_, **__: [(next(sizes), 1)] * len(options))
    steps, planned_at = [0], []
    plan = Engine._plan
    monkeypatch.setattr(Engine, "_plan", lambda self: (planned_at.append(steps[0]), plan(self))[1])
    engine = Engine(TargetStep(target), V)
    row = engine.add(torch.tensor([PROMPTS[0]]), DecodeConfig(method="sd", gamma=4, gamma_schedule="cost",
                                                              max_new_tokens=120), ModelDrafter(draft, V))
    while engine.rows:
        engine.step()
        steps[0] += 1
    gaps = [later - earlier for earlier, later in zip(planned_at, planned_at[1:])]
    assert gaps[:7] == [4, 8, 16, 16, 16, 4, 4] and row.stats.proposed > 0
    assert row.sequence[0, len(PROMPTS[0]):].tolist() == hf_greedy(target, PROMPTS[0], 120)


def test_a_batch_held_back_backs_off_once_its_own_passes_are_priced(target, draft, monkeypatch):
    """A batch's passes are priced apart from one row's (``Profile.batches``), so whether anything is priced yet is
    asked at the batch's rows: two rows held back at every plan back off as one row does, though no one-row pass is
    ever priced (asked of one row, nothing would ever look priced, and plans would come every ``PLAN_EVERY`` steps for
    good)."""
    monkeypatch.setattr(engine_module, "plan", lambda options, *_, **__: [(0, 1)] * len(options))
    steps, planned_at = [0], []
    plan = Engine._plan
    monkeypatch.setattr(Engine, "_plan", lambda self: (planned_at.append(steps[0]), plan(self))[1])
    engine = Engine(TargetStep(target), V)
    config = DecodeConfig(method="sd", gamma=4, gamma_schedule="cost", max_new_tokens=80)
    engine.add_many([Job(torch.tensor([prompt]), config, ModelDrafter(draft, V)) for prompt in PROMPTS[:2]])
    while engine.rows:
        engine.step()
        steps[0] += 1
    gaps = [later - earlier for earlier, later in zip(planned_at, planned_at[1:])]
    assert engine.step_fn.profile.target_ms(1) == 0 and engine.step_fn.profile.target_ms(1, 2) > 0
    assert gaps[:4] == [4, 8, 16, 16]
