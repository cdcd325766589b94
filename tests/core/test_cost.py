"""Cost-aware speculation: the planner's arithmetic, and the engine following it."""
import json
import math
from types import SimpleNamespace

import torch

from conftest import tiny_llama
from fuzzyspec.core import kept
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.cost import (MEMORY, OUTSIDE, POPULATION_MEMORY, PRIOR_ACCEPTANCE, PRIOR_WEIGHT, TARGET, TRIALS,
                                  Acceptance, Option, Profile, context_band, copy_length, plan, population_key, speedup)
from fuzzyspec.core.engine import decode
from fuzzyspec.core.step import TargetStep
from fuzzyspec.drafters.model import ModelDrafter

V = 32


def accepting(rate: float, steps: int = 200) -> Acceptance:
    """The counts of a row that drafted 5 deep ``steps`` times, each draft accepted with probability ``rate``."""
    reached = [steps * rate ** depth for depth in range(5)]
    return Acceptance({1: reached}, {1: [count * rate for count in reached]})


def test_expected_tokens_follow_the_acceptance_per_depth():
    acceptance = accepting(0.5)
    assert math.isclose(acceptance.rate(1), (100 + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (200 + PRIOR_WEIGHT))
    assert math.isclose(acceptance.expected(2)[2], 1 + acceptance.rate(1) + acceptance.rate(1) * acceptance.rate(2))
    fresh = Acceptance()
    assert fresh.expected(1)[1] == 1 + PRIOR_ACCEPTANCE and fresh.rate(3) == PRIOR_ACCEPTANCE  # the prior
    fresh.record(proposed=3, ranks=[1])  # depth 1 passed, depth 2 was reached and failed, depth 3 unseen
    assert fresh.reached == {1: [1, 1, 0]} and fresh.passed == {1: [1, 0, 0]}


def test_where_verifying_costs_as_much_as_decoding_nothing_is_proposed():
    profile = Profile(target={m: 10.0 * m for m in range(1, 40)})  # k tokens cost k single steps
    options = [Option("d", 5)]
    assert plan(options, [accepting(0.9)], profile) == [(0, 1)]


def test_where_verifying_is_nearly_free_the_arithmetic_picks_the_size():
    profile = Profile(target={1: 10.0, 2: 10.5, 3: 11.0, 4: 11.5, 5: 12.0, 6: 12.5}, draft={"d:chain": {
        g: 2.0 * g for g in range(1, 6)}})
    acceptance = accepting(0.7)
    rates = {g: acceptance.expected(g)[g] / (profile.target_ms(1 + g) + profile.draft_ms("d:chain", g))
             for g in range(6)}
    assert plan([Option("d", 5)], [acceptance], profile) == [(max(rates, key=rates.get), 1)]
    assert plan([Option("d", 5)], [acceptance], profile) == plan([Option("d", 5)], [acceptance], profile)
    assert plan([Option("d", 2)], [acceptance], profile)[0][0] <= 2  # the cap holds


def test_the_speed_over_ar_is_the_planners_own_arithmetic_for_its_pick():
    """``speedup``: the planner's pick for one row and E / (T(1 + n) + S + D) over 1 / (T(1) + S), as ``plan`` weighs
    it; exactly 1.0 where it drafts nothing."""
    profile = Profile(target={1: 10.0, 2: 11.0, 3: 12.0}, draft={"d:chain": {1: 1.0, 2: 2.5}}, outside={1: 1.0})
    acceptance = accepting(0.5)
    chosen, faster = speedup(Option("d", 2), acceptance, profile)
    assert chosen == plan([Option("d", 2)], [acceptance], profile)[0] == (1, 1)
    assert math.isclose(faster, acceptance.expected(1)[1] / (11.0 + 1.0 + 1.0) * (10.0 + 1.0))
    dear = Profile(target={m: 10.0 * m for m in range(1, 4)}, draft={"d:chain": {1: 1.0}}, outside={1: 1.0})
    assert speedup(Option("d", 2), acceptance, dear) == ((0, 1), 1.0)


def test_a_copys_length_is_the_one_its_acceptance_and_the_measured_widths_pay_for():
    """A copy from the text takes no model pass: its length trades the tokens its acceptance expects against what
    the wider forward costs. Where a wide pass costs about one step, copies run to the cap; where each token adds a
    lot, they stay short; the choice is the arithmetic's, the cap holds, and the shorter wins a tie."""
    copies = accepting(0.8)
    flat = Profile(target={w: 10.0 + 0.1 * w for w in range(1, 10)}, outside={1: 1.0})
    assert copy_length(copies, flat, 5) == 5 and copy_length(copies, flat, 3) == 3
    steep = Profile(target={1: 10.0, 2: 11.0, 3: 14.0, 4: 17.0, 5: 20.0, 6: 23.0}, outside={1: 1.0})
    rates = {g: copies.expected(g)[g] / (steep.target_ms(1 + g) + 1.0) for g in range(1, 6)}
    assert copy_length(copies, steep, 5) == max(rates, key=rates.get) < 5
    assert copy_length(accepting(0.2), steep, 5) == 1  # at least one token: a copy is not weighed against no draft
    assert copy_length(copies, steep, 0) == 0
    assert copy_length(copies, Profile(target={w: 10.0 for w in range(1, 10)}), 4) == 4
    padded = Profile(target={1: 10.0, 4: 10.0, 8: 30.0})  # widths 2-4 run at 4, 5-8 at 8
    assert copy_length(copies, padded, 5, lambda width, rows: (4 if width <= 4 else 8, rows)) == 3


def test_a_smaller_draft_than_any_measured_is_costed_as_its_share_not_as_the_largest():
    """Measured only at its cap (the first steps draft the most), drafting 5 deep cost as much as 1.4 target
    steps: a 1-deep proposal is then priced at a fifth of that, so the cheap size that pays gets tried."""
    profile = Profile(target={1: 10.0, 2: 10.5, 6: 25.0}, draft={"d:chain": {5: 14.0}})
    assert profile.draft_ms("d:chain", 1) == 14.0 / 5 and profile.draft_ms("d:chain", 0) == 0.0
    assert plan([Option("d", 5)], [accepting(0.7)], profile) == [(1, 1)]


def accepting_wide(rates: dict[int, float], steps: int = 200) -> Acceptance:
    """Counts as ``accepting`` gives, per breadth: drafts ``k`` wide accepted with probability ``rates[k]``."""
    acceptance = Acceptance()
    for breadth, rate in rates.items():
        counted = accepting(rate, steps)
        acceptance.reached[breadth], acceptance.passed[breadth] = counted.reached[1], counted.passed[1]
    return acceptance


def test_trees_are_costed_by_their_nodes_and_batches_by_their_padded_shape():
    option = Option("h", 5, (16, 4))
    assert [option.nodes(g, 4) for g in range(6)] == [0, 4, 16, 16, 16, 16]
    assert [option.nodes(g, 1) for g in range(6)] == [0, 1, 2, 3, 4, 5]  # one child per node: a chain
    assert {k for _, k in option.shapes()} == {1, 2, 4} and option.key(4) == "h:tree4" and option.key(1) == "h:chain"
    profile = Profile(target={1: 10.0, 17: 10.0, 18: 40.0, 128: 40.0})  # up to 17 tokens as cheap as one
    acceptance = accepting_wide({1: 0.6, 2: 0.7, 4: 0.8})
    # alone, a tree of any depth (17 tokens at most) is as cheap as one token: the deepest, widest tree wins
    assert plan([option], [acceptance], profile) == [(5, 4)]
    # beside 3 other rows every row is padded to the widest row's width: a tree's 5 tokens a row are too dear,
    # a chain 3 deep (4 x 4 tokens) is not
    assert plan([option], [acceptance], profile, others=3) == [(3, 1)]


def test_where_a_wide_forward_is_dear_a_tree_narrows_to_a_chain_and_where_it_is_cheap_it_widens():
    """As measured on an AVX-512 CPU with int4 weights, compiled: 5 tokens cost 1.7 steps, 2 cost 1.1, so a tree
    4 wide does not pay even at depth 1 while a chain does; in bfloat16 every width up to 17 costs about one step."""
    option = Option("h", 5, (16, 4))
    acceptance = accepting_wide({1: 0.6, 2: 0.7, 4: 0.8})
    drafting = {"h:chain": {g: 1.1 * g for g in range(1, 6)}, "h:tree2": {g: 1.2 * g for g in range(1, 6)},
                "h:tree4": {g: 1.3 * g for g in range(1, 6)}}
    int4 = Profile(target={1: 6.0, 2: 6.5, 4: 7.5, 6: 10.3, 17: 18.6}, draft=drafting)
    depth, breadth = plan([option], [acceptance], int4)[0]
    assert breadth == 1 and depth >= 1
    bf16 = Profile(target={1: 22.1, 2: 21.6, 4: 21.5, 6: 19.5, 17: 29.5}, draft=drafting)
    assert plan([option], [acceptance], bf16)[0][1] == 4


def test_a_wide_step_informs_every_narrower_breadth():
    """A tree 4 wide whose path took its parents' 1st then 2nd likeliest child: a chain would have kept one
    draft, anything 2 or more wide both; a chain's step tells nothing of wider drafts."""
    acceptance = Acceptance()
    acceptance.record(proposed=3, ranks=[1, 2], breadth=4)
    assert acceptance.reached[1] == [1, 1, 0] and acceptance.passed[1] == [1, 0, 0]
    for k in (2, 3, 4):
        assert acceptance.reached[k] == [1, 1, 1] and acceptance.passed[k] == [1, 1, 0]
    acceptance.record(proposed=2, ranks=[1, 1])
    assert acceptance.passed[1][:2] == [MEMORY + 1, 1] and acceptance.passed[4] == [MEMORY, MEMORY, 0]
    assert Acceptance().rate(1, 4) > Acceptance().rate(1, 2) > Acceptance().rate(1, 1) == PRIOR_ACCEPTANCE  # widens


def test_the_engine_runs_ar_where_speculation_cannot_pay_and_stays_exact_where_it_does(target, draft):
    prompt = torch.tensor([[1, 5, 9, 3, 7, 2]])
    config = DecodeConfig(method="sd", gamma=4, max_new_tokens=30, gamma_schedule="cost")
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False)[0, 6:].tolist()
    dear = TargetStep(target)
    dear.profile = Profile(target={m: 5.0 * m for m in range(1, 64)})
    dear.profile.draft["ModelDrafter:chain"] = {g: 1.0 for g in range(1, 5)}
    tokens, stats = decode(dear, ModelDrafter(draft, V), prompt, config, V)
    assert tokens[0].tolist() == expected and stats.proposed == 0 and stats.target_forwards == 30
    cheap = TargetStep(target)
    cheap.profile = Profile(target={m: 5.0 for m in range(1, 64)}, draft={"ModelDrafter:chain": {
        g: 0.1 for g in range(1, 5)}})
    cheap.profile.target[1] = 5.0
    tokens, stats = decode(cheap, ModelDrafter(draft, V), prompt, config, V)
    assert tokens[0].tolist() == expected and stats.proposed > 0 and stats.target_forwards < 30
    assert cheap.profile.updates > 0  # the engine folds in what it measures as it runs


def test_the_engine_measures_what_it_has_not_seen():
    """With an empty profile the first step runs AR; then a wider step looks as cheap as it and is tried, and
    its measured cost decides from there on."""
    model = tiny_llama(seed=5)
    step = TargetStep(model)
    config = DecodeConfig(method="sd", gamma=3, max_new_tokens=12, gamma_schedule="cost")
    decode(step, ModelDrafter(tiny_llama(seed=6), V), torch.tensor([[1, 2, 3]]), config, V)
    assert 1 in step.profile.target and len(step.profile.target) >= 2


def test_a_compiled_steps_first_call_is_not_taken_for_its_cost(monkeypatch, tmp_path):
    """A call that compiles a graph takes seconds; recorded as a step's cost it would price that width out of
    every later plan (the schedule re-measures only what it runs). Only calls that ran a compiled graph count."""
    monkeypatch.setattr(kept, "folder", lambda: tmp_path)  # (no graph kept by another test: this one compiles)
    step = TargetStep(tiny_llama(seed=5), compile=True, widths=(1, 4))
    compiled_in = []
    step.on_compile = lambda rows, width: compiled_in.append((rows, width))
    config = DecodeConfig(method="sd", gamma=3, max_new_tokens=10, gamma_schedule="constant")
    decode(step, ModelDrafter(tiny_llama(seed=6), V), torch.tensor([[1, 2, 3]]), config, V)
    assert (1, 4) in compiled_in  # the chains' width compiled during decoding ...
    assert set(step.profile.target) == {4} and step.profile.target[4] < 500  # ... and only later calls counted


def test_a_slow_first_measurement_does_not_price_a_size_out():
    """A size's first measurements are tentative (a shared machine's noise only adds time): the planner does not
    see them, so it tries the size again, and their minimum becomes its cost; only settled sizes are kept."""
    profile = Profile(target={1: 10.0}, draft={"d:chain": {1: 1.0}})
    profile.observe_target(2, 40.0)  # a noisy first pass of 2 tokens
    assert profile.target_ms(2) == 10.0  # still untried to the planner: the nearest narrower width's cost
    assert plan([Option("d", 1)], [accepting(0.7)], profile) == [(1, 1)]
    assert profile.to_dict()["target"] == {"1": 10.0}
    profile.observe_target(2, 11.0)
    profile.observe_target(2, 12.0)
    assert profile.target_ms(2) == 11.0 and profile.to_dict()["target"] == {"1": 10.0, "2": 11.0}
    profile.observe_target(2, 20.0)  # settled: later measurements move it by a fraction
    assert 11.0 < profile.target_ms(2) < 20.0


def test_a_prompt_pass_prices_the_widths_beyond_every_settled_one():
    """With only a 1-token pass settled, a first answer priced every untried width at that pass's cost, and ran its
    widest trees first. A prompt's pass draws the line they are priced on instead; settled widths keep their own."""
    profile = Profile(target={1: 10.0, 2: 11.0}, outside={1: 1.0})
    assert profile.target_ms(17) == 11.0  # as the widest settled width, with no prompt seen
    profile.observe_prompt(42, 51.0)
    assert profile.target_ms(22) == 31.0 and profile.target_ms(42) == 51.0 and profile.target_ms(60) == 51.0
    assert profile.target_ms(1) == 10.0 and profile.target_ms(2) == 11.0  # settled: their own
    profile.observe_prompt(2, 30.0)  # narrower than the widest settled width: no guide
    assert profile.target_ms(2) == 11.0 and profile.target_ms(22) == 31.0
    assert "prompts" not in json.dumps(profile.to_dict())  # this process's guide only
    tree = Option("d", 6, tree=(16, 4))
    assert plan([tree], [accepting(0.7)], Profile(target={1: 10.0, 2: 11.0}, outside={1: 1.0})) == [(6, 4)]
    assert plan([tree], [accepting(0.7)], profile) == [(4, 1)]  # a 16-node tree's pass at 26 ms, not 11


def test_the_engine_files_one_rows_prompt_pass_as_a_guide():
    step = TargetStep(tiny_llama(seed=5))
    config = DecodeConfig(method="sd", gamma=3, max_new_tokens=4, gamma_schedule="cost")
    decode(step, ModelDrafter(tiny_llama(seed=6), V), torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), config, V)
    assert list(step.profile.prompts) == [7] and step.profile.prompts[7] > 0  # every prompt token but the newest
    assert 7 not in step.profile.target


def test_a_cost_follows_the_median_of_its_measurements_not_their_spikes():
    """A shared machine's noise only adds time: one step in five taking 4x as long must not raise a width's cost
    (a running mean did, and unevenly: a width the planner stopped running kept its last spike)."""
    profile = Profile(target={1: 10.0, 2: 10.0})
    for i in range(200):
        profile.observe_target(1, 40.0 if i % 5 == 0 else 10.0)
    assert 10.0 <= profile.target_ms(1) < 10.5
    profile.observe_target(2, 40.0)  # one spike, then the planner runs other widths
    assert profile.target_ms(2) < 1.03 * profile.target_ms(1)  # (the spike moved the pace: every cost alike)


def test_a_drift_of_the_machine_moves_every_cost_alike():
    """The machine ran 1.5x slower while the planner ran 1-token passes, then at its own speed while it ran 2-token
    ones: each width's own running median then held 15 ms against 12, and the planner saw 2-token passes as
    cheap as 1-token ones (12 against 10 on either side of the drift). The pace takes the drift; the widths keep
    most of their difference."""
    profile = Profile(target={1: 10.0, 2: 12.0})
    for _ in range(300):
        profile.observe_target(1, 15.0)
    assert 14.0 < profile.target_ms(1) < 16.0 and profile.target_ms(2) / profile.target_ms(1) > 1.15
    for _ in range(300):
        profile.observe_target(2, 12.0)
    assert 11.5 < profile.target_ms(2) < 12.5 and profile.target_ms(2) / profile.target_ms(1) > 1.08
    saved = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))  # saved as milliseconds now
    assert math.isclose(saved.target_ms(2), profile.target_ms(2)) and saved.pace == 1.0


def test_a_size_run_alone_keeps_its_cost_against_the_others():
    """Spikes do not ratchet one size's cost away from the others' while it runs alone."""
    profile = Profile(target={1: 10.0, 2: 12.0})
    for i in range(5000):
        profile.observe_target(1, 40.0 if i % 5 == 0 else 10.0)
    assert math.isclose(profile.target_ms(1), 10.0, rel_tol=0.02)
    assert math.isclose(profile.target_ms(2) / profile.target_ms(1), 1.2, rel_tol=0.02)


def test_costs_set_as_measured_read_back_as_given_whatever_the_pace():
    """``fuzzyspec tune`` files what it just measured. Written straight into the tables (kept over the pace), a
    profile whose pace had moved would read them back scaled by it."""
    profile = Profile(target={1: 10.0, 2: 12.0}, draft={"d:chain": {1: 1.0}}, outside={1: 0.5})
    for _ in range(300):
        profile.observe_target(1, 20.0)
    assert profile.pace > 1.5
    profile.set_measured(TARGET, {1: 6.0, 4: 9.0})
    profile.set_measured("d:chain", {1: 1.5, 2: 2.5})
    profile.set_measured(OUTSIDE, {1: 0.75})
    assert math.isclose(profile.target_ms(1), 6.0) and math.isclose(profile.target_ms(4), 9.0)
    assert math.isclose(profile.draft_ms("d:chain", 2), 2.5) and math.isclose(profile.outside_ms(1), 0.75)
    saved = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert math.isclose(saved.target_ms(4), 9.0) and math.isclose(saved.draft_ms("d:chain", 1), 1.5)


def test_no_width_is_priced_above_a_wider_one():
    """Noise made a 2-token pass look dearer than a 4-token one; the planner then never ran 1-token chains again,
    so their cost was never measured again. A narrower pass does no more work: it costs at most the wider's."""
    profile = Profile(target={1: 5.4, 2: 7.2, 4: 6.4, 17: 16.8}, draft={"d:chain": {1: 1.5, 3: 4.0}},
                      outside={1: 0.5})
    assert profile.target_ms(2) == 6.4 and profile.target_ms(3) == 6.4 and profile.target_ms(1) == 5.4
    assert profile.target_ms(17) == 16.8 and profile.target_ms(30) == 16.8  # wider than any measured: as before
    assert plan([Option("d", 1)], [accepting(0.55)], profile) == [(1, 1)]  # at 7.2 ms, AR


def test_a_batchs_costs_are_kept_apart_from_one_rows():
    """Four rows of one token need not cost what one row of four does: each row count has its own curve, kept
    through a save, and a row count not yet measured, or a width narrower than its measured ones, is guessed from
    the one-row curve."""
    profile = Profile(target={1: 6.0, 4: 7.5})
    assert profile.target_ms(1, rows=4) == 7.5  # not measured yet: one row of 4 tokens
    for _ in range(TRIALS):
        profile.observe_target(1, 14.0, rows=4)
    assert profile.target_ms(1, rows=4) == 14.0 and profile.target_ms(4) == 7.5
    assert profile.target_ms(2, rows=4) == 14.0  # an untried width of a measured row count: its narrower one's
    saved = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert saved.batches == {4: {1: 14.0}} and saved.target == {1: 6.0, 4: 7.5}
    # two rows whose first passes verified drafts: their AR pass is guessed from the one-row curve, not priced
    # as their narrowest measured pass (it would never run, so never be measured)
    for _ in range(TRIALS):
        profile.observe_target(4, 12.0, rows=2)
    assert profile.target_ms(4, rows=2) == 12.0 and profile.target_ms(1, rows=2) == 6.0 + 1.5 / 3


def test_a_long_contexts_passes_are_priced_apart_from_a_short_ones():
    """Every query of a pass attends over the whole context, so a wide pass costs more beside a long one: one row's
    costs are kept per band of contexts, each measured from its own passes, a band not yet measured priced as the
    nearest shorter one (so its drafts are tried, and measured), and kept through a save. The same row then drafts
    after 100 positions and not after 2,000."""
    profile = Profile(target={1: 6.0, 2: 6.3}, draft={"d:chain": {1: 1.5}}, outside={1: 0.5})
    options, acceptance = [Option("d", 1)], accepting(0.6)
    assert context_band(100) == context_band(512) == 0 and context_band(1900) == context_band(2048) == 2048
    assert plan(options, [acceptance], profile, context=100) == [(1, 1)]
    assert plan(options, [acceptance], profile, context=2000) == [(1, 1)]  # untried: the short contexts' costs
    for _ in range(TRIALS):
        for width, ms in ((1, 9.0), (2, 14.0), (3, 19.0), (4, 24.0)):
            profile.observe_target(width, ms, context=1900 + width)
    assert profile.target_ms(2, context=2000) == 14.0 and profile.target_ms(2, context=100) == 6.3
    assert profile.target_ms(2, context=3000) == 14.0  # a longer band, untried: the nearest shorter one's
    assert plan(options, [acceptance], profile, context=2000) == [(0, 1)]
    assert plan(options, [acceptance], profile, context=100) == [(1, 1)]
    assert copy_length(acceptance, profile, 3, context=2000) == 1 and copy_length(acceptance, profile, 3) == 3
    saved = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert saved.longer == {2048: {1: 9.0, 2: 14.0, 3: 19.0, 4: 24.0}} and saved.target == {1: 6.0, 2: 6.3}


def test_a_band_prices_its_unmeasured_narrower_widths_from_a_shorter_band():
    """A long band whose first passes verified drafts (compiled: a 2-token pass runs at width 4) must not price a
    1-token pass as dear as its narrowest measured one: then the row drafts at every step and AR is never run there,
    so never measured (a chat 2,300 positions long decoded at 0.8x AR that way). The narrower width takes the
    shorter band's cost (a pass beside a shorter context costs no more), so AR is tried, and once measured, kept
    where drafts do not pay."""
    profile = Profile(target={1: 7.8, 4: 8.8, 17: 21.8}, draft={"d:chain": {1: 2.0}}, outside={1: 0.9})
    options, acceptance = [Option("d", 1)], accepting(0.45)
    def four_wide(width, rows):
        return (1 if width == 1 else 4), rows
    for _ in range(TRIALS):
        profile.observe_target(4, 18.0, context=2400)
    assert profile.target_ms(4, context=2400) == 18.0 and profile.target_ms(1, context=2400) == 7.8
    assert plan(options, [acceptance], profile, four_wide, context=2400) == [(0, 1)]  # AR is tried
    for _ in range(TRIALS):
        profile.observe_target(1, 10.5, context=2400)
    assert profile.target_ms(1, context=2400) == 10.5 and profile.target_ms(2, context=2400) == 13.0
    assert plan(options, [acceptance], profile, four_wide, context=2400) == [(0, 1)]
    assert plan(options, [acceptance], profile, four_wide, context=100) == [(1, 1)]
    # a band further on, untried: every width as the nearest shorter band's, the narrower ones as before it
    assert profile.target_ms(1, context=5000) == 10.5 and profile.target_ms(4, context=5000) == 18.0


def test_the_engine_files_a_long_contexts_passes_in_its_band():
    model = tiny_llama(seed=5)
    step = TargetStep(model)
    config = DecodeConfig(method="sd", gamma=3, max_new_tokens=8, gamma_schedule="cost")
    prompt = torch.randint(0, V, (1, 600), generator=torch.Generator().manual_seed(0))
    decode(step, ModelDrafter(tiny_llama(seed=6), V), prompt, config, V)
    assert set(step.profile.longer) == {1024} and 1 in step.profile.longer[1024] and not step.profile.target


def test_prepare_compiles_every_shape_the_schedule_may_pick(monkeypatch, tmp_path):
    """Compiled ahead, every width a tree row's drafts may take (each breadth, each depth), so that decoding
    under the cost schedule never stops to compile a one-row shape at that cache size."""
    from fuzzyspec import tuning

    monkeypatch.setattr(kept, "folder", lambda: tmp_path)  # (no graph kept by another test: this one compiles)

    step = TargetStep(tiny_llama(seed=5), compile=True, widths=(1, 2, 4, 8, 16))
    compiled = []
    step.on_compile = lambda rows, width: compiled.append(width)
    config = DecodeConfig(method="sd", tree=True, tree_total_tokens=6, tree_depth=3, tree_top_k=2)
    option = Option.of("h", config)
    assert option == Option("h", 3, (6, 2))
    assert option.widths() == (1, 2, 3, 4, 7)  # nothing, chains 1-3 deep, trees 2 wide of 2 and 6 nodes
    tuning.prepare(SimpleNamespace(step=step, draft=SimpleNamespace(name="h", prepare=None)), config)
    assert sorted(compiled) == [1, 2, 4, 8]  # each padded to its width bucket, once


def test_prepare_compiles_the_eagle_heads_step_too(tmp_path):
    """A compiled pair's EAGLE head runs compiled steps of its own (``drafters.head_step``): ``prepare`` compiles
    them ahead with the target's, so decoding chains and trees, eight times past the head cache's first capacity,
    compiles nothing."""
    from torch._dynamo.utils import counters

    from fuzzyspec import tuning
    from fuzzyspec.drafters.eagle_head import EagleHead
    from fuzzyspec.drafters.registry import load_drafter

    target = tiny_llama(seed=5)
    torch.manual_seed(0)
    EagleHead.for_target(target).save(tmp_path)
    source = load_drafter(f"eagle:{tmp_path}", target, None)
    assert source.prepare is not None
    step = TargetStep(target, compile=True, widths=(1, 2, 4, 8))
    chain = DecodeConfig(method="sd", gamma=3, max_new_tokens=12, gamma_schedule="constant")
    tree = DecodeConfig(method="sd", tree=True, tree_total_tokens=6, tree_depth=3, tree_top_k=2, max_new_tokens=12,
                        gamma_schedule="constant")
    for config in (chain, tree):
        tuning.prepare(SimpleNamespace(step=step, draft=source), config)
    graphs = counters["stats"]["unique_graphs"]
    for config in (chain, tree):
        for prompt in ([1, 2, 3], list(range(1, 31)) * 9):
            drafter = source.new(V)
            decode(step, drafter, torch.tensor([prompt]), config, V)
            assert drafter.compiled
    assert drafter.cache.capacity == 512
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_graphs_prepared_ahead_are_the_ones_decoding_runs():
    """Dynamo guards on strides too: graphs compiled for ``prepare``'s sliced inputs were compiled again for
    the engine's own (a 7-10 s stop inside a timed answer). After ``prepare``, decoding compiles nothing."""
    from torch._dynamo.utils import counters

    from fuzzyspec import tuning

    step = TargetStep(tiny_llama(seed=5), compile=True, widths=(1, 2, 4))
    config = DecodeConfig(method="sd", gamma=3, max_new_tokens=12, gamma_schedule="constant")
    tuning.prepare(SimpleNamespace(step=step, draft=SimpleNamespace(name="ModelDrafter", prepare=None)), config)
    graphs = counters["stats"]["unique_graphs"]
    decode(step, ModelDrafter(tiny_llama(seed=6), V), torch.tensor([[1, 2, 3]]), config, V)
    decode(step, None, torch.tensor([[1, 2, 3]]), DecodeConfig(method="ar", max_new_tokens=4), V)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_compiled_cpu_steps_cache_starts_large_enough_for_a_chat():
    """Each cache capacity is a graph of its own: a first pass at a new one compiles the target again inside the
    answer (8 s a width for the embedded model). A compiled CPU step's cache starts at ``COMPILED_CPU_CAPACITY``, so
    after ``prepare`` an answer that passes 256 or 512 positions compiles nothing; eager steps start small."""
    from torch._dynamo.utils import counters

    from fuzzyspec import tuning
    from fuzzyspec.core.step import COMPILED_CPU_CAPACITY, MIN_CAPACITY

    step = TargetStep(tiny_llama(seed=5), compile=True, widths=(1, 2, 4))
    assert step.min_capacity == COMPILED_CPU_CAPACITY > 512 and TargetStep(step.model).min_capacity == MIN_CAPACITY
    config = DecodeConfig(method="ar", max_new_tokens=8)
    tuning.prepare(SimpleNamespace(step=step, draft=SimpleNamespace(name="ModelDrafter", prepare=None)),
                   DecodeConfig(method="sd", gamma=3, gamma_schedule="constant"))
    decode(step, None, torch.tensor([[1, 2, 3]]), config, V)
    graphs = counters["stats"]["unique_graphs"]
    prompt = torch.tensor([list(range(1, 31)) * 20])  # 600 positions
    compiled, _ = decode(step, None, prompt, config, V)
    assert counters["stats"]["unique_graphs"] == graphs
    eager, _ = decode(TargetStep(step.model), None, prompt, config, V)
    assert compiled.tolist() == eager.tolist()


def test_a_row_that_stopped_drafting_tries_again():
    """A poor stretch stops a row's drafting; steps that draft nothing fade its counts too, so its estimate drifts
    back to the prior and it drafts again (counts that faded only when it drafted kept it at AR for good). A few
    misses do not stop it: its answer's average so far, with the prior, decides."""
    profile = Profile(target={1: 10.0, 2: 11.0}, draft={"d:chain": {1: 2.0}}, outside={1: 1.0})
    acceptance = Acceptance()
    for _ in range(3):
        acceptance.record(proposed=1, ranks=[])  # three misses in a row: still drafting
    assert plan([Option("d", 1)], [acceptance], profile) == [(1, 1)]
    for _ in range(30):
        acceptance.record(proposed=1, ranks=[])
    assert plan([Option("d", 1)], [acceptance], profile) == [(0, 1)]
    waited = 0
    while plan([Option("d", 1)], [acceptance], profile) == [(0, 1)] and waited < 1000:
        acceptance.fade()
        waited += 1
    assert 5 < waited < 300


def test_a_row_stops_drafting_only_where_it_is_sure_drafting_loses(monkeypatch):
    """Four misses at an answer's start put a row's estimate under break-even, on 14 drafts' worth of evidence (its
    own and the prior's): it drafts on, where before it stopped, and a stopped row measures nothing, so it stayed
    stopped. Forty misses in fifty drafts stop it."""
    from fuzzyspec.core import cost

    profile = Profile(target={1: 10.0, 2: 12.5}, draft={"d:chain": {1: 2.5}}, outside={1: 1.0})
    even = (12.5 + 2.5 + 1.0) / (10.0 + 1.0) - 1  # the first-draft acceptance at which a 1-token chain pays
    unlucky = Acceptance()
    for _ in range(4):
        unlucky.record(proposed=1, ranks=[])
    assert unlucky.rate(1) < even < unlucky.rates(1, doubt=cost.DOUBT)[0]
    assert plan([Option("d", 1)], [unlucky], profile) == [(1, 1)]
    poor = Acceptance()
    for step in range(50):
        poor.record(proposed=1, ranks=[1] if step % 5 == 0 else [])
    assert plan([Option("d", 1)], [poor], profile) == [(0, 1)]
    monkeypatch.setattr(cost, "DOUBT", 0.0)  # as before: wherever the estimate says drafting loses
    assert plan([Option("d", 1)], [unlucky], profile) == [(0, 1)]


def test_a_draft_is_priced_at_all_it_adds_to_a_step(monkeypatch):
    """What a step that drafts spends beyond its forward and beyond a step that drafts nothing is the draft's cost:
    here a slow judge of drafts, which the proposal's own time would not show."""
    import time

    from fuzzyspec.core import engine

    step = TargetStep(tiny_llama(seed=5))
    prompt = torch.tensor([[1, 2, 3]])
    decode(step, None, prompt, DecodeConfig(method="ar", max_new_tokens=6), V)
    assert 0 < step.profile.outside_ms(1) < 30  # a step that drafts nothing: sampling and bookkeeping
    judge = engine.judge

    def slow_judge(config, draft, *args):
        if draft is not None and len(draft):
            time.sleep(0.03)
        return judge(config, draft, *args)

    monkeypatch.setattr(engine, "judge", slow_judge)
    config = DecodeConfig(method="sd", gamma=2, max_new_tokens=8, gamma_schedule="constant")
    decode(step, ModelDrafter(tiny_llama(seed=6), V), prompt, config, V)
    assert min(ms for size, ms in step.profile.draft_costs("ModelDrafter:chain").items() if size) > 25
    saved = Profile.from_dict(json.loads(json.dumps(step.profile.to_dict())))
    assert math.isclose(saved.outside_ms(1), step.profile.outside_ms(1))


def test_a_new_row_starts_from_what_the_drafters_earlier_rows_met():
    """A row's prior is its drafter's acceptance over earlier rows under the same rule (kept with the profile, so a
    process's first answer starts from it too), not a fixed 0.6 at every depth: a drafter whose second drafts
    pass far less often than its first no longer sends every new row into deep drafts for its first steps."""
    profile = Profile()
    population = profile.population(population_key("d", "sd", 0.0, True))
    first = Acceptance(population=population)
    assert first.rate(1) == PRIOR_ACCEPTANCE  # nothing learnt yet: the fixed prior
    for step in range(400):  # first drafts pass 60% of the time, second ones (after a first passed) 1 in 9
        passed = 0 if step % 5 >= 3 else 2 if step % 15 == 0 else 1
        first.record(proposed=2, ranks=[1] * passed)
    assert population.reached[1][0] > 300  # (fading by POPULATION_MEMORY a step)
    second = Acceptance(population=profile.population(population_key("d", "sd", 0.0, True)))
    assert abs(second.rate(1) - 0.6) < 0.02 and second.rate(2) < 0.25
    assert Acceptance(population=profile.population(population_key("d", "fsd", 0.3, True))).rate(2) == PRIOR_ACCEPTANCE
    kept = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    again = Acceptance(population=kept.population(population_key("d", "sd", 0.0, True)))
    assert math.isclose(again.rate(2), second.rate(2)) and kept.populations[population_key("d", "sd", 0.0, True)].memory \
        == POPULATION_MEMORY


def test_the_engine_files_each_rows_acceptance_under_its_drafter_and_rule(target, draft):
    step = TargetStep(target)
    config = DecodeConfig(method="sd", gamma=2, max_new_tokens=12, gamma_schedule="cost")
    decode(step, ModelDrafter(draft, V), torch.tensor([[1, 2, 3]]), config, V)
    (key, population), = step.profile.populations.items()
    assert key == population_key("ModelDrafter", "sd", config.threshold, True) and population.reached[1][0] > 0
