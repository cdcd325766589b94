import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_llama
from fuzzyspec.trees import Tree, keep_path, tree_forward

#        root
#       /    \
#      0      1
#     / \      \
#    2   3      4
#    |
#    5
TREE = Tree(tokens=torch.tensor([11, 12, 13, 14, 15, 16]), parents=torch.tensor([-1, -1, 0, 0, 1, 2]))


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=32, layers=2, seed=4)


def test_tree_structure():
    assert TREE.depth.tolist() == [1, 1, 2, 2, 2, 3]
    assert TREE.path_to(5) == [0, 2, 5] and TREE.path_to(4) == [1, 4]
    assert TREE.ancestors()[5].tolist() == [True, False, True, False, False, True]
    with pytest.raises(ValueError):
        Tree(tokens=torch.tensor([1, 2]), parents=torch.tensor([1, -1]))


@pytest.mark.parametrize("cached_len", [0, 5])
def test_tree_pass_equals_separate_path_passes(model, cached_len):
    """Every node's logits equal a plain forward over prefix + root + the node's path."""
    prefix = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        cache = DynamicCache()
        if cached_len:
            model(prefix[:, :cached_len], past_key_values=cache, use_cache=True)
        logits = tree_forward(model, cache, prefix[:, cached_len:], TREE)
        assert cache.get_seq_length() == prefix.shape[1] + len(TREE)
        for node in range(len(TREE)):
            path = TREE.tokens[TREE.path_to(node)]
            plain = model(torch.cat([prefix, path[None]], 1)).logits[0, -1]
            assert torch.allclose(logits[0, prefix.shape[1] - cached_len + node], plain, atol=1e-4), node
        assert torch.allclose(logits[0, : prefix.shape[1] - cached_len],
                              model(prefix).logits[0, cached_len:], atol=1e-4)


def test_keeping_a_path_equals_recomputation(model):
    prefix = torch.tensor([[7, 7, 2, 9]])
    with torch.no_grad():
        cache = DynamicCache()
        tree_forward(model, cache, prefix, TREE)
        path = TREE.path_to(5)
        keep_path(cache, prefix.shape[1], path)
        assert cache.get_seq_length() == prefix.shape[1] + len(path)
        following = torch.tensor([[21, 22]])
        cached = model(following, past_key_values=cache, use_cache=True).logits
        fresh = model(torch.cat([prefix, TREE.tokens[path][None], following], 1)).logits[:, -2:]
    assert torch.allclose(cached, fresh, atol=1e-4)
