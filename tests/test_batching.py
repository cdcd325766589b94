import pytest
import torch

from fuzzyspec.batching import BatchDecoder, PaddedCache, decode_batch
from fuzzyspec.decoding import DecodeConfig, decode
from fuzzyspec.drafters import ModelDrafter
from fuzzyspec.sampling import Sampling

V = 32
PROMPTS = [[1, 5, 9, 3, 7, 2], [4], [8, 8, 8, 1, 0, 30, 31, 2, 2, 6, 17], [3, 3], [12, 20, 7, 7, 1]]


def alone(target, draft, prompt, config):
    drafter = None if config.method == "ar" else ModelDrafter(draft, V)
    tokens, stats = decode(target, drafter, torch.tensor([prompt]), config, V)
    return tokens[0].tolist(), stats


@pytest.mark.parametrize("method, extra", [("ar", {}), ("sd", {}), ("fsd", {"threshold": 0.2}),
                                           ("fsd", {"threshold": 0.6, "divergence": "tv"}),
                                           ("fsd-hybrid", {"threshold": 0.3})])
def test_each_row_is_what_it_would_be_alone_greedy(target, draft, method, extra):
    configs = [DecodeConfig(method=method, gamma=g, max_new_tokens=n, **extra)
               for g, n in zip([4, 5, 2, 6, 3], [30, 7, 25, 1, 40])]
    batched = decode_batch(target, draft, [torch.tensor([p]) for p in PROMPTS], configs, V)
    for prompt, config, (tokens, stats) in zip(PROMPTS, configs, batched):
        expected, expected_stats = alone(target, draft, prompt, config)
        assert tokens == expected
        assert (stats.accepted, stats.proposed) == (expected_stats.accepted, expected_stats.proposed)


def test_rows_with_different_rules_share_a_batch(target, draft):
    configs = [DecodeConfig(method="ar", max_new_tokens=20), DecodeConfig(method="sd", gamma=3, max_new_tokens=20),
               DecodeConfig(method="fsd", threshold=0.3, max_new_tokens=20),
               DecodeConfig(method="fsd", divergence="kl_pq", threshold=0.5, max_new_tokens=20),
               DecodeConfig(method="fsd-hybrid", threshold=0.1, gamma=7, max_new_tokens=20)]
    batched = decode_batch(target, draft, [torch.tensor([p]) for p in PROMPTS], configs, V)
    for prompt, config, (tokens, _) in zip(PROMPTS, configs, batched):
        assert tokens == alone(target, draft, prompt, config)[0]


@pytest.mark.parametrize("method", ["sd", "fsd", "fsd-hybrid"])
def test_seeded_sampling_rows_match_decoding_alone(target, draft, method):
    configs = [DecodeConfig(method=method, threshold=0.3, max_new_tokens=24, seed=seed,
                            sampling=Sampling(temperature=0.9, top_k=20)) for seed in range(len(PROMPTS))]
    batched = decode_batch(target, draft, [torch.tensor([p]) for p in PROMPTS], configs, V)
    for prompt, config, (tokens, _) in zip(PROMPTS, configs, batched):
        assert tokens == alone(target, draft, prompt, config)[0]


def test_rows_join_and_leave_between_steps(target, draft):
    """Continuous batching: rows arrive at different steps, finish at different steps; compaction runs."""
    decoder = BatchDecoder(target, draft, V, compact_after=3)
    config = DecodeConfig(method="fsd", threshold=0.25, gamma=4)
    lengths = [12, 30, 5, 20, 16]
    rows, finished = [], []
    for i, prompt in enumerate(PROMPTS):
        rows.append(decoder.add(torch.tensor([prompt]), DecodeConfig(**{**config.__dict__,
                                                                        "max_new_tokens": lengths[i]})))
        finished += decoder.step()
        finished += decoder.step()
    while decoder.rows:
        finished += decoder.step()
    assert sorted(map(id, finished)) == sorted(map(id, rows))
    for prompt, row in zip(PROMPTS, rows):
        assert row.tokens == alone(target, draft, prompt, row.config)[0]
        assert row.finish_reason == "length" and len(row.tokens) == row.config.max_new_tokens


def test_eos_and_callbacks_stop_a_row(target, draft):
    full, _ = alone(target, draft, PROMPTS[0], DecodeConfig(method="sd", max_new_tokens=20))
    eos = full[6]
    decoder = BatchDecoder(target, draft, V)
    stopped = decoder.add(torch.tensor([PROMPTS[0]]), DecodeConfig(method="sd", max_new_tokens=20,
                                                                   eos_token_ids=(eos,)))
    seen = []
    called = decoder.add(torch.tensor([PROMPTS[2]]), DecodeConfig(method="fsd", max_new_tokens=20),
                         on_tokens=lambda new: seen.extend(new[0].tolist()) or len(seen) >= 5)
    while decoder.rows:
        decoder.step()
    assert stopped.tokens == full[: full.index(eos) + 1] and stopped.finish_reason == "stop"
    assert called.finish_reason == "stop" and seen == called.tokens and 5 <= len(called.tokens) < 20


def test_padded_cache_compact_keeps_each_rows_valid_positions(target):
    cache = PaddedCache(valid=torch.zeros(2, 0, dtype=torch.bool))
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    cache.forward(target, tokens, torch.tensor([[True, True, True, True], [False, True, True, True]]), 1)
    cache.drop(0, 2)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.cache.layers]
    cache.compact()
    assert cache.valid.tolist() == [[False, True, True], [True, True, True]]
    for (k0, _), layer in zip(before, cache.cache.layers):
        assert torch.equal(layer.keys[0, :, 1:], k0[0, :, :2]) and torch.equal(layer.keys[1], k0[1, :, 1:])


def test_batching_refuses_what_it_cannot_do(target, draft):
    decoder = BatchDecoder(target, None, V)
    with pytest.raises(ValueError, match="needs a draft model"):
        decoder.add(torch.tensor([[1, 2]]), DecodeConfig(method="sd"))
    with pytest.raises(ValueError, match="fixed-length chains"):
        BatchDecoder(target, draft, V).add(torch.tensor([[1, 2]]), DecodeConfig(method="sd",
                                                                                gamma_schedule="heuristic"))


def test_padded_forward_equals_a_plain_forward_of_each_rows_valid_tokens(target):
    """Holes and left padding are invisible: a row's logits are those of its valid tokens alone."""
    cache = PaddedCache(valid=torch.zeros(2, 0, dtype=torch.bool))
    first = torch.tensor([[3, 9, 4, 4, 8], [0, 0, 7, 1, 2]])
    cache.forward(target, first, torch.tensor([[True] * 5, [False, False, True, True, True]]), 1)
    cache.drop(0, 3)  # row 0 keeps 3, 9, 4: positions 3 and 4 become holes
    cache.compact()   # and the holes move into left padding of row 0 only partly (row 1 is longer)
    cache.forward(target, torch.tensor([[6, 6], [5, 5]]), torch.ones(2, 2, dtype=torch.bool), 1)
    cache.drop(1, cache.valid.shape[1] - 1)  # row 1 drops its newest token
    logits = cache.forward(target, torch.tensor([[11, 12], [13, 14]]), torch.ones(2, 2, dtype=torch.bool), 2)
    for row, tokens in enumerate([[3, 9, 4, 6, 6, 11, 12], [7, 1, 2, 5, 13, 14]]):
        with torch.no_grad():
            expected = target(torch.tensor([tokens])).logits[0, -2:]
        torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)


def test_a_decoder_is_reused_after_its_batch_empties(target, draft):
    decoder = BatchDecoder(target, draft, V)
    for prompt, n in [(PROMPTS[2], 9), (PROMPTS[0], 5), (PROMPTS[1], 12)]:
        config = DecodeConfig(method="fsd", max_new_tokens=n)
        row = decoder.add(torch.tensor([prompt]), config)
        while decoder.rows:
            decoder.step()
        assert row.tokens == alone(target, draft, prompt, config)[0]


def test_draft_only_and_failed_adds_leave_the_batch_intact(target, draft, monkeypatch):
    decoder = BatchDecoder(target, draft, V)
    with pytest.raises(ValueError, match="finite threshold"):
        decoder.add(torch.tensor([[1, 2]]), DecodeConfig(method="fsd", threshold=float("inf")))
    config = DecodeConfig(method="sd", max_new_tokens=15)
    row = decoder.add(torch.tensor([PROMPTS[0]]), config)
    decoder.step()
    original = type(draft).forward

    def broken(self, *args, **kwargs):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(type(draft), "forward", broken)  # the draft prefill of the next prompt fails
    with pytest.raises(RuntimeError):
        decoder.add(torch.tensor([PROMPTS[2]]), config)
    monkeypatch.setattr(type(draft), "forward", original)
    while decoder.rows:
        decoder.step()
    assert row.tokens == alone(target, draft, PROMPTS[0], config)[0]


def test_pending_draft_tokens_pile_up_while_no_row_drafts(target, draft):
    """An AR-only batch feeds the draft nothing; a drafting row joining later makes it catch up."""
    decoder = BatchDecoder(target, draft, V, compact_after=2)
    ar = decoder.add(torch.tensor([PROMPTS[0]]), DecodeConfig(method="ar", max_new_tokens=30))
    for _ in range(6):
        decoder.step()
    fsd = decoder.add(torch.tensor([PROMPTS[2]]), DecodeConfig(method="fsd", threshold=0.3, max_new_tokens=30))
    compactions = []
    original = PaddedCache.compact
    PaddedCache.compact = lambda self: (compactions.append(1), original(self))[1]
    try:
        while decoder.rows:
            decoder.step()
    finally:
        PaddedCache.compact = original
    assert ar.tokens == alone(target, draft, PROMPTS[0], ar.config)[0]
    assert fsd.tokens == alone(target, draft, PROMPTS[2], fsd.config)[0]
    assert compactions  # the holes of rejected drafts were packed away on the way


def test_eager_attention_gets_an_additive_mask(draft):
    from conftest import tiny_llama
    eager = tiny_llama(seed=0)
    eager.set_attn_implementation("eager")
    configs = [DecodeConfig(method="fsd", threshold=0.3, max_new_tokens=20) for _ in PROMPTS]
    batched = decode_batch(eager, draft, [torch.tensor([p]) for p in PROMPTS], configs, V)
    for prompt, config, (tokens, _) in zip(PROMPTS, configs, batched):
        assert tokens == alone(eager, draft, prompt, config)[0]
