"""The engine with many rows: each row decodes as it would alone, whatever shares its batch."""
import sys

import pytest
import torch

from conftest import tiny_llama
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.draft import Draft, GrownShape
from fuzzyspec.core import engine as engine_module
from fuzzyspec.core.engine import Engine, Job, decode, decode_batch, target_features
from fuzzyspec.core.step import LlamaForward, TargetStep
from fuzzyspec.drafters.model import ModelDrafter
from fuzzyspec.drafters.eagle import EagleDrafter
from fuzzyspec.drafters.eagle3 import make_eagle3
from fuzzyspec.drafters.lookup import LookupDrafter
from fuzzyspec.core.sampling import Sampling
from fuzzyspec.core.vocab import DraftVocab

V = 32
PROMPTS = [[1, 5, 9, 3, 7, 2], [4], [8, 8, 8, 1, 0, 30, 31, 2, 2, 6, 17], [3, 3], [12, 20, 7, 7, 1]]


@pytest.fixture(scope="module")
def head(target):
    torch.manual_seed(0)
    head = make_eagle3(target, DraftVocab(torch.arange(0, V, 2), V))
    with torch.no_grad():
        for name, weight in head.named_parameters():
            if "norm" not in name and weight.requires_grad:
                weight.normal_(0, 0.3)
    return head.eval()


def drafter_for(kind, target, draft, head):
    return {"ar": lambda: None, "draft": lambda: ModelDrafter(draft, V), "eagle": lambda: EagleDrafter(head, target, V),
            "lookup": lambda: LookupDrafter(3)}[kind]()


def alone(target, drafter, prompt, config):
    tokens, stats = decode(target, drafter, torch.tensor([prompt]), config, V)
    return tokens[0].tolist(), stats


@pytest.mark.parametrize("method, extra", [("ar", {}), ("sd", {}), ("fsd", {"threshold": 0.2}),
                                           ("fsd", {"threshold": 0.6, "divergence": "tv"}),
                                           ("fsd-hybrid", {"threshold": 0.3})])
def test_each_row_is_what_it_would_be_alone_greedy(target, draft, method, extra):
    configs = [DecodeConfig(method=method, gamma=g, max_new_tokens=n, **extra)
               for g, n in zip([4, 5, 2, 6, 3], [30, 7, 25, 1, 40])]
    drafters = [None if method == "ar" else ModelDrafter(draft, V) for _ in PROMPTS]
    batched = decode_batch(target, [torch.tensor([p]) for p in PROMPTS], configs, drafters, V)
    for prompt, config, (tokens, stats) in zip(PROMPTS, configs, batched):
        expected, expected_stats = alone(target, None if method == "ar" else ModelDrafter(draft, V), prompt, config)
        assert tokens == expected
        assert (stats.accepted, stats.proposed) == (expected_stats.accepted, expected_stats.proposed)


@pytest.fixture(scope="module")
def compiled(target):
    """The target's step compiled at one width bucket (every step padded to 32 tokens a row, so only the row
    counts give new shapes: few compilations), shared by the tests below."""
    return TargetStep(target, compile=True, widths=(32,))


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_rows_mix_drafters_shapes_rules_and_schedules(target, draft, head, compiled, mode):
    """Chains from a draft LM, an EAGLE-3 head and prompt lookup, EAGLE-2 trees, AR, the heuristic gamma
    schedule and draft-confidence stops, all in one batch; compiled steps (padded widths and rows) give each
    row the tokens it gets alone, eagerly."""
    rows = [("ar", DecodeConfig(method="ar", max_new_tokens=20)),
            ("draft", DecodeConfig(method="sd", gamma=3, max_new_tokens=20, gamma_schedule="heuristic")),
            ("eagle", DecodeConfig(method="fsd", threshold=0.3, max_new_tokens=20, tree=True, tree_total_tokens=8,
                                   tree_depth=3, tree_top_k=3)),
            ("lookup", DecodeConfig(method="sd", max_new_tokens=20)),
            ("eagle", DecodeConfig(method="fsd-hybrid", threshold=0.1, gamma=4, max_new_tokens=20,
                                   draft_confidence=0.3)),
            ("draft", DecodeConfig(method="fsd", divergence="kl_pq", threshold=0.5, max_new_tokens=20)),
            ("eagle", DecodeConfig(method="sd", max_new_tokens=20, tree=True))]
    prompts = [PROMPTS[i % len(PROMPTS)] * 2 for i in range(len(rows))]
    drafters = [drafter_for(kind, target, draft, head) for kind, _ in rows]
    batched = decode_batch(compiled if mode == "compiled" else target, [torch.tensor([p]) for p in prompts],
                           [c for _, c in rows], drafters, V)
    for prompt, (kind, config), (tokens, stats) in zip(prompts, rows, batched):
        expected, expected_stats = alone(target, drafter_for(kind, target, draft, head), prompt, config)
        assert tokens == expected, kind
        assert stats.accepted == expected_stats.accepted
        if kind in ("draft", "eagle"):
            assert stats.proposed > 0


@pytest.mark.parametrize("method", ["sd", "fsd", "fsd-hybrid"])
def test_seeded_sampling_rows_match_decoding_alone(target, draft, head, method):
    configs = [DecodeConfig(method=method, threshold=0.3, max_new_tokens=24, seed=seed,
                            sampling=Sampling(temperature=0.9, top_k=20)) for seed in range(len(PROMPTS))]
    kinds = ["draft", "eagle", "lookup", "draft", "eagle"]
    drafters = [drafter_for(kind, target, draft, head) for kind in kinds]
    batched = decode_batch(target, [torch.tensor([p]) for p in PROMPTS], configs, drafters, V)
    for prompt, config, kind, (tokens, _) in zip(PROMPTS, configs, kinds, batched):
        assert tokens == alone(target, drafter_for(kind, target, draft, head), prompt, config)[0]


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_rows_join_and_leave_between_steps(target, draft, compiled, mode):
    """Continuous batching: rows arrive at different steps, finish at different steps, and later rows take
    the slots earlier ones freed (compiled: at padded shapes, each row still decodes as it would alone)."""
    engine = Engine(compiled if mode == "compiled" else target, V)
    lengths = [12, 30, 5, 20, 16]
    rows, finished = [], []
    for i, prompt in enumerate(PROMPTS):
        config = DecodeConfig(method="fsd", threshold=0.25, gamma=4, max_new_tokens=lengths[i])
        rows.append(engine.add(torch.tensor([prompt]), config, ModelDrafter(draft, V)))
        finished += engine.step()
        finished += engine.step()
    while engine.rows:
        finished += engine.step()
    assert sorted(map(id, finished)) == sorted(map(id, rows))
    assert len({row.slot for row in rows}) < len(rows)  # a freed slot was taken again
    for prompt, row in zip(PROMPTS, rows):
        assert row.tokens == alone(target, ModelDrafter(draft, V), prompt, row.config)[0]
        assert row.finish_reason == "length" and len(row.tokens) == row.config.max_new_tokens


def test_eos_and_callbacks_stop_a_row(target, draft):
    full, _ = alone(target, ModelDrafter(draft, V), PROMPTS[0], DecodeConfig(method="sd", max_new_tokens=20))
    eos = full[6]
    engine = Engine(target, V)
    stopped = engine.add(torch.tensor([PROMPTS[0]]), DecodeConfig(method="sd", max_new_tokens=20, eos_token_ids=(eos,)),
                         ModelDrafter(draft, V))
    seen = []
    called = engine.add(torch.tensor([PROMPTS[2]]), DecodeConfig(method="fsd", max_new_tokens=20),
                        ModelDrafter(draft, V), on_tokens=lambda new: seen.extend(new[0].tolist()) or len(seen) >= 5)
    while engine.rows:
        engine.step()
    assert stopped.tokens == full[: full.index(eos) + 1] and stopped.finish_reason == "stop"
    assert called.finish_reason == "stop" and seen == called.tokens and 5 <= len(called.tokens) < 20


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_ar_rows_run_one_step_ahead(target, draft, compiled, mode):
    """``lookahead`` (a GPU's default, forced here): AR rows, greedy and sampled, of different lengths, one ending
    at EOS and one by its callback, rows joining midway, and a drafting row joining later (the steps stop running
    ahead), each get the tokens, finish reasons and pass counts they get alone without it."""
    step = compiled if mode == "compiled" else target
    full = alone(target, None, PROMPTS[0], DecodeConfig(method="ar", max_new_tokens=30))[0]
    cut = next(i for i, token in enumerate(full) if i >= 5 and full.index(token) == i)  # its first time there
    eos = full[cut]
    configs = [DecodeConfig(method="ar", max_new_tokens=30, eos_token_ids=(eos,)),
               DecodeConfig(method="ar", max_new_tokens=7),
               DecodeConfig(method="ar", max_new_tokens=25, seed=4, sampling=Sampling(temperature=0.9, top_k=20)),
               DecodeConfig(method="ar", max_new_tokens=1),
               DecodeConfig(method="ar", max_new_tokens=40)]
    engine = Engine(step, V, lookahead=True)
    seen = []
    rows = [engine.add(torch.tensor([PROMPTS[0]]), configs[0]),
            engine.add(torch.tensor([PROMPTS[1]]), configs[1]),
            engine.add(torch.tensor([PROMPTS[2]]), configs[2], on_tokens=lambda new: seen.extend(new[0].tolist())
                       or len(seen) >= 11)]
    finished = []
    for _ in range(3):
        finished += engine.step()
    rows += [engine.add(torch.tensor([PROMPTS[3]]), configs[3]), engine.add(torch.tensor([PROMPTS[4]]), configs[4])]
    for _ in range(4):
        finished += engine.step()
    chained = DecodeConfig(method="sd", gamma=3, max_new_tokens=12)
    rows.append(engine.add(torch.tensor([PROMPTS[0]]), chained, ModelDrafter(draft, V)))
    while engine.rows:
        finished += engine.step()
    assert sorted(map(id, finished)) == sorted(map(id, rows))
    assert rows[0].tokens == full[: cut + 1] and rows[0].finish_reason == "stop"
    assert rows[2].finish_reason == "stop" and seen == rows[2].tokens and len(seen) == 11
    assert rows[2].tokens == alone(target, None, PROMPTS[2], configs[2])[0][:11]
    for prompt, config, row in zip(PROMPTS[1:], configs[1:], rows[1:]):
        if row is not rows[2]:
            expected, stats = alone(target, None, prompt, config)
            assert row.tokens == expected and row.finish_reason == "length"
            assert row.stats.target_forwards == stats.target_forwards == len(expected)
    assert rows[5].tokens == alone(target, ModelDrafter(draft, V), PROMPTS[0], chained)[0]
    assert engine.cache is None and engine._queued is None


def test_a_row_in_the_last_slot_ending_first_while_steps_run_ahead(target):
    """The last slot's row ends while the others go on, with a step queued ahead that still holds it: its slot
    leaves the batch at once (trailing empty slots are dropped), and reading that queued step drops its token."""
    configs = [DecodeConfig(method="ar", max_new_tokens=20), DecodeConfig(method="ar", max_new_tokens=5)]
    engine = Engine(target, V, lookahead=True)
    rows = [engine.add(torch.tensor([prompt]), config) for prompt, config in zip(PROMPTS, configs)]
    while engine.rows:
        engine.step()
    for prompt, config, row in zip(PROMPTS, configs, rows):
        expected, stats = alone(target, None, prompt, config)
        assert row.tokens == expected and row.stats.target_forwards == stats.target_forwards
    assert engine.cache is None and engine._queued is None


def test_rows_coming_and_going_at_random_while_steps_run_ahead(target, draft, head, monkeypatch):
    """With ``lookahead`` forced (a GPU's default), rows join at random steps into a batch whose other rows run
    ahead, draft (a chain under a constant schedule), or are held back and let draft now and then by a scripted
    schedule; they end by length, EOS or a stop callback, in any slot. Every row gets the tokens it gets alone,
    greedy, and the engine ends with nothing queued."""
    import random

    chooser = random.Random(0)
    sizes = iter(chooser.choice([0, 0, 0, 1, 2]) for _ in range(10**5))
    monkeypatch.setattr(engine_module, "plan", lambda options, *_, **__: [(next(sizes), 1)] * len(options))
    ahead, run_ahead = [], Engine._step_ahead
    monkeypatch.setattr(Engine, "_step_ahead", lambda self: ahead.append(1) or run_ahead(self))
    engine = Engine(target, V, lookahead=True)
    made = []  # (row, prompt, config, kind, stop after)
    for step in range(160):
        if step < 120 and chooser.random() < 0.3:
            prompt = chooser.choice(PROMPTS)
            kind = chooser.choice(["ar", "ar", "draft", "eagle"])
            config = DecodeConfig(method="ar" if kind == "ar" else "sd", gamma=3, max_new_tokens=chooser.randint(1, 30),
                                  gamma_schedule="cost" if kind == "eagle" else "constant",
                                  eos_token_ids=(chooser.randrange(V),) if chooser.random() < 0.3 else ())
            stop = chooser.randint(1, 12) if chooser.random() < 0.2 else None
            seen = []
            callback = None if stop is None else (lambda new, seen=seen, stop=stop:
                                                  seen.extend(new[0].tolist()) or len(seen) >= stop)
            made.append((engine.add(torch.tensor([prompt]), config, drafter_for(kind, target, draft, head),
                                    on_tokens=callback), prompt, config, kind, stop))
        if engine.rows:
            engine.step()
    while engine.rows:
        engine.step()
    assert len(made) > 20 and {kind for *_, kind, _ in made} == {"ar", "draft", "eagle"} and len(ahead) > 50
    for row, prompt, config, kind, stop in made:
        expected = alone(target, drafter_for(kind, target, draft, head), prompt, config)[0]
        if stop is not None and row.finish_reason == "stop" and len(row.tokens) < len(expected):
            assert len(row.tokens) >= stop and row.tokens == expected[: len(row.tokens)]  # (ended by its callback)
        else:
            assert row.tokens == expected, (kind, config)
    assert engine.cache is None and engine._queued is None


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_rows_the_schedule_holds_back_run_ahead_and_keep_their_features(target, head, compiled, mode, monkeypatch):
    """Rows whose drafter the cost schedule holds back run one step ahead as AR rows do (``lookahead``, forced
    here), and their drafters get the target's features of those passes: whenever the schedule lets them draft
    again, each drafter holds the features of every position before the newest, as one pass over the sequence
    computes them, and every row gets greedy AR's tokens."""
    step = compiled if mode == "compiled" else target
    sizes = iter([0, 0, 2, 0, 1, 0, 0, 3] * 10)  # the schedule's draft size at each plan, for every row
    monkeypatch.setattr(engine_module, "plan", lambda options, *_, **__: [(next(sizes), 1)] * len(options))
    monkeypatch.setattr(engine_module, "PLAN_EVERY", 2)
    ahead, seen = [], []  # steps run ahead; (sequence, the drafter's features) at each proposal
    run_ahead, propose = Engine._step_ahead, EagleDrafter.propose
    monkeypatch.setattr(Engine, "_step_ahead", lambda self: ahead.append(1) or run_ahead(self))

    def watched(self, sequence, *args):
        seen.append((sequence.clone(), self.features[:, : self.known].clone()))
        return propose(self, sequence, *args)
    monkeypatch.setattr(EagleDrafter, "propose", watched)
    configs = [DecodeConfig(method="sd", gamma=3, gamma_schedule="cost", max_new_tokens=30),
               DecodeConfig(method="ar", max_new_tokens=12),
               DecodeConfig(method="sd", gamma=3, gamma_schedule="cost", max_new_tokens=20)]
    engine = Engine(step, V, lookahead=True)
    rows = [engine.add(torch.tensor([PROMPTS[0]]), configs[0], EagleDrafter(head, target, V)),
            engine.add(torch.tensor([PROMPTS[1]]), configs[1])]
    for _ in range(3):
        engine.step()
    rows.append(engine.add(torch.tensor([PROMPTS[2]]), configs[2], EagleDrafter(head, target, V)))
    while engine.rows:
        engine.step()
    for prompt, config, row in zip((PROMPTS[0], PROMPTS[1], PROMPTS[2]), configs, rows):
        ar = DecodeConfig(method="ar", max_new_tokens=config.max_new_tokens)
        assert row.tokens == alone(target, None, prompt, ar)[0]
    assert len(ahead) >= 4 and sum(row.stats.proposed for row in rows) > 0
    assert len(seen) >= 3
    for sequence, features in seen:
        assert features.shape[1] == sequence.shape[1] - 1
        with torch.no_grad():
            hidden = target(sequence[:, :-1], output_hidden_states=True).hidden_states
        expected = target_features(dict(enumerate(hidden)), rows[0].drafter, target.config.num_hidden_layers)
        torch.testing.assert_close(features, expected, atol=1e-4, rtol=1e-4)


def test_the_engine_refuses_what_it_cannot_do(target, draft):
    engine = Engine(target, V)
    with pytest.raises(ValueError, match="needs a drafter"):
        engine.add(torch.tensor([[1, 2]]), DecodeConfig(method="sd"))
    with pytest.raises(ValueError, match="drafts trees"):
        engine.add(torch.tensor([[1, 2]]), DecodeConfig(method="sd", tree=True), ModelDrafter(draft, V))
    with pytest.raises(ValueError, match="at least one token"):
        engine.add(torch.tensor([[]], dtype=torch.long), DecodeConfig(method="ar"))
    assert not engine.rows


def test_draft_only_rows_decode_alone_beside_verified_ones(target, draft):
    configs = [DecodeConfig(method="fsd", threshold=float("inf"), max_new_tokens=15),
               DecodeConfig(method="sd", max_new_tokens=15)]
    batched = decode_batch(target, [torch.tensor([PROMPTS[0]]), torch.tensor([PROMPTS[2]])], configs,
                           [ModelDrafter(draft, V), ModelDrafter(draft, V)], V)
    draft_alone = draft.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=15, do_sample=False)[0, 6:].tolist()
    assert batched[0][0] == draft_alone and batched[0][1].target_forwards == 0
    assert batched[1][0] == alone(target, ModelDrafter(draft, V), PROMPTS[2], configs[1])[0]


def test_a_failed_add_leaves_the_batch_intact(target, draft, monkeypatch):
    engine = Engine(target, V)
    config = DecodeConfig(method="sd", max_new_tokens=15)
    row = engine.add(torch.tensor([PROMPTS[0]]), config, ModelDrafter(draft, V))
    engine.step()
    original = LlamaForward.forward

    def broken(self, *args, **kwargs):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(LlamaForward, "forward", broken)  # the prefill of the next prompt fails
    with pytest.raises(RuntimeError):
        engine.add(torch.tensor([PROMPTS[2]]), config, ModelDrafter(draft, V))
    monkeypatch.setattr(LlamaForward, "forward", original)
    while engine.rows:
        engine.step()
    assert row.tokens == alone(target, ModelDrafter(draft, V), PROMPTS[0], config)[0]


def test_eager_attention_gets_an_additive_mask(draft):
    eager = tiny_llama(seed=0)
    eager.set_attn_implementation("eager")
    configs = [DecodeConfig(method="fsd", threshold=0.3, max_new_tokens=20) for _ in PROMPTS]
    batched = decode_batch(eager, [torch.tensor([p]) for p in PROMPTS], configs,
                           [ModelDrafter(draft, V) for _ in PROMPTS], V)
    for prompt, config, (tokens, _) in zip(PROMPTS, configs, batched):
        assert tokens == alone(eager, ModelDrafter(draft, V), prompt, config)[0]


class DeviceReads:
    """Counts the places where Python reads a tensor's values (each one a wait for the device on a GPU), by
    the file that reads: on the CPU nothing waits, but the same calls would."""

    METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.by_file: dict[str, int] = {}
        for name in self.METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))

    def _counted(self, method):
        def counted(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            self.by_file[caller] = self.by_file.get(caller, 0) + 1
            return method(tensor, *args, **kwargs)
        return counted

    def count(self, *parts: str) -> int:
        return sum(n for file, n in self.by_file.items() if any(part in file for part in parts))


def test_a_step_reads_the_device_once(target, draft, head, monkeypatch):
    """The hot loop waits for the device once per step, for every row's outcome together: AR rows, chains
    under every rule (greedy and sampled) and sd trees (greedy and sampled). A tree is grown on the device
    (``EagleDrafter._tree``) and its shape read with the outcome."""
    rows = [("ar", DecodeConfig(method="ar", max_new_tokens=200)),
            ("draft", DecodeConfig(method="sd", gamma=4, max_new_tokens=200)),
            ("draft", DecodeConfig(method="sd", gamma=3, max_new_tokens=200, seed=1, sampling=Sampling(temperature=1.0))),
            ("draft", DecodeConfig(method="fsd", threshold=0.3, gamma=3, max_new_tokens=200, seed=2,
                                   sampling=Sampling(temperature=0.8))),
            ("eagle", DecodeConfig(method="fsd-hybrid", threshold=0.2, gamma=4, max_new_tokens=200)),
            ("eagle", DecodeConfig(method="sd", max_new_tokens=200, tree=True, tree_depth=4)),
            ("eagle", DecodeConfig(method="sd", max_new_tokens=200, tree=True, tree_depth=3, seed=3,
                                   sampling=Sampling(temperature=0.9)))]
    engine = Engine(target, V)
    engine.add_many([Job(torch.tensor([PROMPTS[i % len(PROMPTS)]]), config, drafter_for(kind, target, draft, head))
                     for i, (kind, config) in enumerate(rows)])
    engine.step()  # the EAGLE rows draft from the second step on
    reads = DeviceReads(monkeypatch)
    steps = 6
    for _ in range(steps):
        engine.step()
    assert len(engine.rows) == len(rows)
    # core/draft.py reads a draft's shape, which lives on the CPU by construction
    assert reads.count("fuzzyspec/core/", "fuzzyspec/drafters/model.py") - reads.count("fuzzyspec/core/draft.py") \
        == steps, reads.by_file
    # (a tree is grown on the device, and its shape read with the step's outcome)
    assert reads.count("fuzzyspec/drafters/eagle.py") == 0, reads.by_file


def test_drafts_keep_their_shape_on_the_host():
    draft = Draft.chain(torch.tensor([3, 4, 5]))
    assert draft.parents.device.type == "cpu" and draft.is_chain and draft.depths == [1, 2, 3]
    tree = Draft(torch.tensor([3, 4, 5]), torch.tensor([-1, -1, 0]))
    assert not tree.is_chain and tree.children == [[0, 1], [2], [], []] and tree.depths == [1, 1, 2]
    # a path's places among siblings (the cost schedule learns from them how wide a draft needs to be)
    assert tree.ranks([1]) == [2] and tree.ranks([0, 2]) == [1, 1] and draft.ranks([0, 1, 2]) == [1, 1, 1]
    with pytest.raises(ValueError, match="parent"):
        Draft(torch.tensor([3, 4]), torch.tensor([-1, 1]))
    # a tree grown on the device: its shape is there until the step's outcome brings it (a chain shaped one stays a
    # tree, as it was laid out and judged)
    parents = torch.tensor([-1, 0, 1])
    grown = Draft(torch.tensor([3, 4, 5]), None, grown=GrownShape(parents, torch.ones(3, 3).tril().bool(),
                                                                   torch.tensor([1, 2, 3]), 2))
    assert grown.parent_ids is None and not grown.is_chain
    grown.learn_shape(parents.tolist())
    assert grown.depths == [1, 2, 3] and grown.ancestors().equal(grown.grown.ancestors) and not grown.is_chain
    with pytest.raises(ValueError, match="parents"):
        Draft(torch.tensor([3, 4]), None)



def test_chain_layouts_are_right_and_kept_unwritten(target, draft, head, monkeypatch):
    """A step whose rows all draft chains (or nothing) reads its tree and depths from ``_chain_layout``, which keeps
    them between steps: each chain's nodes see themselves and the nodes before them, padding itself alone; and
    decoding chains, trees and AR, batched and alone, leaves every kept layout as it was made."""
    tree, depths = engine_module._chain_layout.__wrapped__((2, 0, 1), 4, torch.device("cpu"))
    chain_of_3 = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]
    chain_of_2 = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    assert tree.int().tolist() == [chain_of_3, torch.eye(4, dtype=torch.int).tolist(), chain_of_2]
    assert depths.tolist() == [[0, 1, 2, 0], [0, 0, 0, 0], [0, 1, 0, 0]]
    handed_out = {}
    kept = engine_module._chain_layout

    def recording(sizes, width, device):
        handed_out[sizes, width, device] = layout = kept(sizes, width, device)
        return layout
    monkeypatch.setattr(engine_module, "_chain_layout", recording)
    rows = [("draft", DecodeConfig(method="sd", gamma=3, max_new_tokens=16)),
            ("eagle", DecodeConfig(method="sd", max_new_tokens=16, tree=True, tree_total_tokens=6, tree_depth=3)),
            ("ar", DecodeConfig(method="ar", max_new_tokens=16)),
            ("draft", DecodeConfig(method="fsd", threshold=0.4, gamma=2, max_new_tokens=16))]
    decode_batch(target, [torch.tensor([p]) for p in PROMPTS[: len(rows)]], [c for _, c in rows],
                 [drafter_for(kind, target, draft, head) for kind, _ in rows], V)
    for kind, config in rows:  # (one row's steps lay out their tokens their own way)
        decode(target, drafter_for(kind, target, draft, head), torch.tensor([PROMPTS[0]]), config, V)
    assert any(max(sizes) > 0 for sizes, _, _ in handed_out) and any(len(sizes) > 1 for sizes, _, _ in handed_out)
    for (sizes, width, device), (tree, depths) in handed_out.items():
        fresh_tree, fresh_depths = kept.__wrapped__(sizes, width, device)
        assert torch.equal(tree, fresh_tree) and torch.equal(depths, fresh_depths), (sizes, width)
