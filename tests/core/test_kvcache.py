"""The static cache's helpers (``core.kvcache``)."""
import pytest
import torch

from fuzzyspec.core import kernels, kvcache
from fuzzyspec.core.kvcache import attention_mask, chain_tree


def torch_mask(starts, tree, capacity, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "loaded", lambda: False)
        return attention_mask(starts, tree, capacity)


@pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable()}")
def test_an_attention_mask_in_one_call_is_the_tensor_operations_one(monkeypatch):
    """On the CPU the mask is one call of our kernels, where PyTorch made seven operations: the same mask for rows at
    different lengths, chains (an expanded view), trees and a cache filled to its last position; a draft past the
    cache is refused in one line."""
    generator = torch.Generator().manual_seed(0)
    for rows, width, capacity in ((1, 1, 8), (1, 6, 16), (3, 4, 12), (2, 17, 40)):
        starts = torch.randint(0, capacity - width + 1, (rows,), generator=generator)
        starts[0] = capacity - width  # (the cache's last positions)
        # a chain (an expanded view, as the engine passes one), and a tree (every node sees itself)
        trees = [chain_tree(rows, width, "cpu"),
                 (torch.rand(rows, width, width, generator=generator) < 0.5) | torch.eye(width, dtype=torch.bool)]
        for tree in trees:
            ours = attention_mask(starts, tree, capacity)
            assert ours.shape == (rows, 1, width, capacity) and ours.dtype == torch.bool
            assert torch.equal(ours, torch_mask(starts, tree, capacity, monkeypatch))
    assert kvcache.kernels.loaded()
    with pytest.raises(RuntimeError, match="attention_mask: 2 positions from 7 past a cache of 8"):
        attention_mask(torch.tensor([7]), chain_tree(1, 2, "cpu"), 8)
