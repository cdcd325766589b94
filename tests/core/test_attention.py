"""Our CPU attention: it is attention, and a query's numbers depend only on the keys and values it sees."""
import pytest
import torch
import torch.nn.functional as F

from fuzzyspec.core import kernels
from fuzzyspec.core.attention import attend

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable()}")


def random_pass(rows, width, heads, kv_heads, dim, capacity, seed):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, width, heads, dim, generator=generator)
    keys = torch.randn(rows, kv_heads, capacity, dim, generator=generator)
    values = torch.randn(rows, kv_heads, capacity, dim, generator=generator)
    mask = torch.rand(rows, 1, width, capacity, generator=generator) < 0.6
    mask[..., 0] = True  # every query sees something
    return query, keys, values, mask


@pytest.mark.parametrize("dim", [8, 12, 64])
def test_it_is_attention_with_grouped_heads_and_any_mask(dim):
    query, keys, values, mask = random_pass(2, 5, 6, 2, dim, 40, seed=dim)
    expected = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, attn_mask=mask, scale=0.3,
                                              enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(attend(query, keys, values, mask, 0.3), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [8, 16, 24, 32, 40, 48, 56, 80])
@pytest.mark.parametrize("heads, kv_heads", [(7, 1), (8, 4)])
def test_every_head_size_in_whole_chunks_of_8_is_attention(heads, kv_heads, dim):
    """The values are weighed up to 8 chunks of 8 dimensions at a time for one head, 4 for two or three heads
    together (``weigh_chunks``): every count of chunks, alone or after whole groups (7 heads of a kv head are taken
    3, 3 and 1; 2 heads as a pair)."""
    query, keys, values, mask = random_pass(2, 3, heads, kv_heads, dim, 40, seed=dim)
    expected = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, attn_mask=mask, scale=0.3,
                                              enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(attend(query, keys, values, mask, 0.3), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [12, 64])
def test_it_is_attention_over_a_cache_with_long_unwritten_runs(dim):
    """A cache's mask, not a random one: runs of allowed positions and runs of unwritten ones (which the kernel
    passes over 8 at a time), a capacity that is no multiple of 8."""
    query, keys, values, _ = random_pass(2, 3, 6, 2, dim, 45, seed=dim)
    mask = torch.zeros(2, 1, 3, 45, dtype=torch.bool)
    mask[0, 0, :, :17] = True
    mask[0, 0, :, 30:33] = True  # drafts written after a gap
    mask[1, 0, :, :9] = True
    mask[1, 0, 2, 40:45] = True  # the last positions, up to the capacity
    expected = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, attn_mask=mask, scale=0.3,
                                              enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(attend(query, keys, values, mask, 0.3), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (7, 1, 12), (8, 4, 64)])
def test_it_is_attention_over_a_long_context_split_among_tasks(heads, kv_heads, dim):
    """Past 128 positions a query's positions are split into spans whose sums are combined: still attention, with
    any number of heads sharing a kv head (taken three at a time)."""
    query, keys, values, mask = random_pass(2, 3, heads, kv_heads, dim, 1500, seed=heads)
    mask[1, 0, 2, 200:] = False  # a query of fewer spans beside longer ones
    expected = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, attn_mask=mask, scale=0.3,
                                              enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(attend(query, keys, values, mask, 0.3), expected, rtol=1e-5, atol=1e-5)


def test_a_long_contexts_result_does_not_depend_on_the_thread_count():
    query, keys, values, mask = random_pass(1, 2, 9, 3, 64, 2000, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(query, keys.half(), values.half(), mask, 0.125)
        torch.set_num_threads(2)
        two = attend(query, keys.half(), values.half(), mask, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("seen", [23, 128, 129, 700])
def test_a_querys_result_depends_only_on_the_keys_it_sees_in_order(seen):
    """Alone over positions 0 .. n-1, or in a wider pass of several rows with the same keys and values scattered
    (in the same order) among positions it may not see: bit for bit the same, in one span or several. This is what
    makes a tree node's verification score it as AR's one-token step does."""
    heads, kv_heads, dim = 6, 2, 64
    query, keys, values, _ = random_pass(1, 1, heads, kv_heads, dim, seen, seed=1)
    alone = attend(query, keys, values, torch.ones(1, 1, 1, seen, dtype=torch.bool), 0.125)

    wide_query, wide_keys, wide_values, wide_mask = random_pass(3, 6, heads, kv_heads, dim, 2 * seen + 40, seed=2)
    where = torch.sort(torch.randperm(2 * seen + 40, generator=torch.Generator().manual_seed(3))[:seen]).values
    wide_query[1, 4] = query[0, 0]
    wide_keys[1][:, where], wide_values[1][:, where] = keys[0], values[0]
    wide_mask[1, 0, 4] = False
    wide_mask[1, 0, 4, where] = True
    together = attend(wide_query, wide_keys, wide_values, wide_mask, 0.125)
    assert torch.equal(together[1, 4], alone[0, 0])


def test_a_float16_cache_is_read_as_the_floats_it_holds():
    """A 4-bit target caches its keys and values in float16: attention over them is, bit for bit, attention over
    the same numbers in float32 (each widened exactly), so it keeps every property above."""
    for dim in (12, 64):
        query, keys, values, mask = random_pass(2, 5, 6, 2, dim, 300, seed=dim)
        keys, values = keys.half(), values.half()
        assert torch.equal(attend(query, keys, values, mask, 0.3), attend(query, keys.float(), values.float(), mask, 0.3))


def test_bad_operands_are_one_clear_error():
    query, keys, values, mask = random_pass(1, 2, 4, 2, 8, 10, seed=0)
    with pytest.raises(RuntimeError, match="bool mask"):
        attend(query, keys, values, mask.float(), 1.0)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        attend(query, keys, values, mask[..., :9], 1.0)
    with pytest.raises(RuntimeError, match="float32 or float16 keys"):
        attend(query, keys.half(), values, mask, 1.0)
