"""judge: a row's rule applied to its draft, in two halves (on the device, then on the host)."""
import torch

from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.draft import Draft
from fuzzyspec.core.judge import judge
from fuzzyspec.core.rules import sd
from fuzzyspec.core.sampling import Sampling
from fuzzyspec.core.tree_rules import walk

V = 7


def verdict(config, draft, logits, generator=None):
    pending = judge(config, draft, logits, generator)
    return pending.finish(pending.values.tolist())


def test_greedy_chains_keep_the_drafts_the_targets_argmax_agrees_with():
    """Greedy SD reads argmaxes alone: the verdict is the vectorised rule's, whether every draft, none or some
    pass (the last kept draft followed by the target's own token)."""
    config = DecodeConfig(method="sd", sampling=Sampling(temperature=0))
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        n = int(torch.randint(1, 5, (), generator=generator))
        logits = torch.randn(n + 1, V, generator=generator)
        drafts = torch.where(torch.rand(n, generator=generator) < 0.7, logits[:n].argmax(-1),
                             torch.randint(0, V, (n,), generator=generator))
        accepted, token = sd(drafts[None], logits.float().softmax(-1)[None], None, None, 0.0, True, None)
        got = verdict(config, Draft.chain(drafts), logits)
        assert got.path == list(range(int(accepted))) and got.token == int(token) and got.proposed == n
        assert got.emitted == drafts[: int(accepted)].tolist() + [int(token)]
        seen.add(int(accepted) == n)
    assert seen == {True, False}


def test_greedy_trees_follow_the_walk():
    config = DecodeConfig(method="sd", tree=True, sampling=Sampling(temperature=0))
    tree = Draft(torch.tensor([2, 0, 4, 1, 3]), torch.tensor([-1, -1, -1, 0, 0]))
    generator = torch.Generator().manual_seed(1)
    for _ in range(50):
        logits = torch.randn(6, V, generator=generator)
        logits[0, 2] += 2 * float(torch.rand((), generator=generator) < 0.6)  # the root's first child passes often
        got = verdict(config, tree, logits)
        assert (got.path, got.token) == walk("sd", tree, logits.softmax(-1), None, 0.0, True)
        assert got.proposed == 2 and got.drafted == [2, 0, 4, 1, 3]


def test_a_row_without_drafts_takes_the_argmax_or_a_draw():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    assert verdict(DecodeConfig(method="sd", sampling=Sampling(temperature=0)), None, logits).emitted == [1]
    drawn = {verdict(DecodeConfig(method="sd", sampling=Sampling(temperature=1.0)), None, logits, torch.Generator().manual_seed(seed)).token
             for seed in range(40)}
    assert 1 in drawn and len(drawn) > 1
