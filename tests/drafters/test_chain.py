"""draft_chain: the token-by-token loop the model drafters share."""
import torch

from fuzzyspec.core.draft import Budget
from fuzzyspec.core.sampling import Sampling
from fuzzyspec.drafters.chain import draft_chain

V = 11


def scripted(seed: int):
    """Logits for the first token, and an ``advance`` giving each next one (from the token it is fed)."""
    table = torch.randn(V, 1, V, generator=torch.Generator().manual_seed(seed))
    return table[0], lambda token: table[int(token)]


def test_a_greedy_chain_keeps_its_distributions_only_where_asked():
    """The same tokens either way; with ``distributions`` the draft holds each token's q and logits (and a zero row
    after the last), without them none (the rule reads none)."""
    first, advance = scripted(0)
    kept = draft_chain(first, advance, Budget(4, distributions=True), Sampling(temperature=0), None)
    bare = draft_chain(first, advance, Budget(4, distributions=False), Sampling(temperature=0), None)
    assert bare.tokens.tolist() == kept.tokens.tolist() and len(kept) == 4
    assert bare.q is None and bare.logits is None and not bare.sampled and bare.is_chain
    assert kept.q.shape == (5, V) and torch.allclose(kept.q[0], first.softmax(-1)[0])
    assert kept.q[4].abs().sum() == 0
    expected, logits = [], first
    for _ in range(4):
        expected.append(int(logits.argmax()))
        logits = advance(expected[-1])
    assert kept.tokens.tolist() == expected


def test_a_confidence_floor_stops_a_chain_even_without_distributions():
    """No draft distribution is certain of its token, so a floor of 1 stops the chain after the first token (which
    is always proposed)."""
    first, advance = scripted(1)
    full = draft_chain(first, advance, Budget(6, distributions=False), Sampling(temperature=0), None)
    stopped = draft_chain(first, advance, Budget(6, min_confidence=1.0, distributions=False),
                          Sampling(temperature=0), None)
    assert len(full) == 6
    assert len(stopped) == 1 and stopped.tokens[0] == full.tokens[0]
