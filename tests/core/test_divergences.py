import math

import pytest
import torch

from fuzzyspec.core.divergences import ALIASES, NAMES, divergence


def kl(a, b):
    """Independent reference: plain Python, 0 log 0 = 0, zero denominators floored at 1e-10."""
    return sum(x * math.log(x / max(y, 1e-10)) for x, y in zip(a, b) if x > 0)


P = [0.5, 0.3, 0.2, 0.0]
Q = [0.25, 0.25, 0.0, 0.5]
M = [(x + y) / 2 for x, y in zip(P, Q)]

CLOSED_FORM = {
    "kl_pq": kl(P, Q),
    "kl_qp": kl(Q, P),
    "js": 0.5 * kl(P, M) + 0.5 * kl(Q, M),
    "js_legacy": 0.5 * kl(M, P) + 0.5 * kl(M, Q),
    "tv": 0.5 * sum(abs(x - y) for x, y in zip(P, Q)),
    "hellinger": math.sqrt(0.5 * sum((math.sqrt(x) - math.sqrt(y)) ** 2 for x, y in zip(P, Q))),
}


@pytest.mark.parametrize("name", sorted(CLOSED_FORM))
def test_closed_form_with_zeros(name):
    value = divergence(torch.tensor(P), torch.tensor(Q), name)
    assert value.dtype == torch.float32
    assert value.item() == pytest.approx(CLOSED_FORM[name], rel=1e-5)


def test_known_values():
    p, q = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    assert divergence(p, q, "js").item() == pytest.approx(math.log(2), rel=1e-6)
    assert divergence(p, q, "tv").item() == pytest.approx(1.0)
    assert divergence(p, q, "hellinger").item() == pytest.approx(1.0)
    half = torch.tensor([0.5, 0.5])
    assert divergence(half, torch.tensor([0.9, 0.1]), "kl_pq").item() == pytest.approx(
        0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), rel=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_nonnegative_finite_zero_on_equal(name):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 7, 300, generator=g) * 3
    p = logits.softmax(-1)
    q = (logits + torch.randn(4, 7, 300, generator=g)).softmax(-1)
    q[..., :50] = 0  # zeros where p has mass
    q = q / q.sum(-1, keepdim=True)
    d = divergence(p, q, name)
    assert d.shape == (4, 7)
    assert torch.isfinite(d).all() and (d >= 0).all()
    assert torch.allclose(divergence(p, p, name), torch.zeros(4, 7), atol=1e-5)


def test_bfloat16_inputs_are_summed_in_float32():
    g = torch.Generator().manual_seed(1)
    p = torch.randn(3, 1000, generator=g).softmax(-1)
    q = torch.randn(3, 1000, generator=g).softmax(-1)
    exact = divergence(p, q, "kl_pq")
    low = divergence(p.bfloat16(), q.bfloat16(), "kl_pq")
    assert low.dtype == torch.float32
    assert torch.allclose(low, exact, rtol=0.05)


def test_top_k_bucket():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    # top-2 of the target: tokens 0 and 1; rest buckets: p 0.3, q 0.7; no renormalisation.
    bins_p, bins_q = [0.4, 0.3, 0.3], [0.1, 0.2, 0.7]
    assert divergence(p, q, "topk_kl_pq", top_k=2).item() == pytest.approx(kl(bins_p, bins_q), rel=1e-5)
    assert divergence(p, q, "topk_tv", top_k=2).item() == pytest.approx(0.5 * (0.3 + 0.1 + 0.4), rel=1e-5)
    # k >= V keeps everything: equal to the plain divergence.
    assert divergence(p, q, "topk_js", top_k=10).item() == pytest.approx(divergence(p, q, "js").item(), rel=1e-5)


def test_top_p_bucket():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])
    # top_p 0.7: the target's smallest set reaching 0.7 is tokens {0, 1} (0.8).
    bins_p, bins_q = [0.5, 0.3, 0.2], [0.25, 0.25, 0.5]
    assert divergence(p, q, "topp_kl_qp", top_p=0.7).item() == pytest.approx(kl(bins_q, bins_p), rel=1e-5)


def test_reference_code_aliases():
    g = torch.Generator().manual_seed(2)
    p = torch.randn(5, 64, generator=g).softmax(-1)
    q = torch.randn(5, 64, generator=g).softmax(-1)
    assert torch.equal(divergence(p, q, "kl_div"), divergence(p, q, "kl_qp"))
    assert torch.equal(divergence(p, q, "kl_div_reversed"), divergence(p, q, "kl_pq"))
    assert torch.equal(divergence(p, q, "js_div"), divergence(p, q, "js_legacy"))
    assert torch.equal(divergence(p, q, "top_k_js_div"), divergence(p, q, "topk_js_legacy"))
    # The reference code's js_div is not the standard JS.
    assert not torch.allclose(divergence(p, q, "js_div"), divergence(p, q, "js"))
    assert set(ALIASES) >= {"kl_div", "kl_div_reversed", "js_div", "tv_div", "top_k_kl_div", "top_k_js_div",
                            "top_k_tv_div"}


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="valid: .*js.*kl_div"):
        divergence(torch.ones(2) / 2, torch.ones(2) / 2, "cosine")


@pytest.mark.parametrize("name", NAMES)
def test_a_point_mass_needs_no_one_hot(name):
    """D(p, q) with q certain of a token (prompt lookup) equals the dense divergence against the one-hot."""
    from fuzzyspec.core.divergences import point_divergence
    g = torch.Generator().manual_seed(7)
    p = (torch.randn(6, 40, generator=g) * 3).softmax(-1)
    tokens = torch.tensor([0, 5, 39, int(p[3].argmax()), 7, int(p[5].argsort()[-2])])
    dense = divergence(p, torch.nn.functional.one_hot(tokens, 40).float(), name, top_k=5, top_p=0.8)
    torch.testing.assert_close(point_divergence(p, tokens, name, top_k=5, top_p=0.8), dense, rtol=1e-4, atol=1e-5)


def test_distinct_but_nearly_equal_distributions_have_a_positive_divergence():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(200, 50, generator=g).softmax(-1)
    q = (p + 1e-7 * torch.randn(200, 50, generator=g)).clamp_min(0)
    q = q / q.sum(-1, keepdim=True)
    for name in ("js", "kl_pq", "kl_qp", "js_legacy", "tv", "hellinger"):
        assert bool((divergence(p, q, name) > 0).all()), name


def test_only_zeros_are_floored():
    """A tiny positive denominator keeps its exact value: KL(q || p) for p = (1, 1e-15), q = (1/2, 1/2)."""
    exact = 0.5 * math.log(0.5) + 0.5 * math.log(0.5 / 1e-15)
    assert divergence(torch.tensor([1.0, 1e-15]), torch.tensor([0.5, 0.5]), "kl_div").item() == \
        pytest.approx(exact, rel=1e-5)
