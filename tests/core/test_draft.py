import pytest
import torch

from fuzzyspec.core.draft import Draft


def tree() -> Draft:
    """The root's children 0 and 1; 2 and 3 below 0; 4 below 2; 5 below 1."""
    return Draft(torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([-1, -1, 0, 0, 2, 1]))


def test_the_shape_of_a_tree():
    """What the engine lays a step out from (the target's tree mask, positions) and the planner learns from."""
    draft = tree()
    assert not draft.is_chain and Draft.chain(torch.tensor([5, 6, 7])).is_chain
    assert draft.depths == [1, 1, 2, 2, 3, 2]
    assert draft.children == [[0, 1], [2, 3], [5], [4], [], [], []]
    assert draft.ranks([0, 3]) == [1, 2] and draft.ranks([1, 5]) == [2, 1]
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [0, 1, 0, 0, 0, 0],
                             [1, 0, 1, 0, 0, 0],
                             [1, 0, 0, 1, 0, 0],
                             [1, 0, 1, 0, 1, 0],
                             [0, 1, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(draft.ancestors(), expected)
    assert Draft(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)).ancestors().shape == (0, 0)


def test_a_parent_after_its_child_is_refused():
    with pytest.raises(ValueError, match="parent"):
        Draft(torch.tensor([1, 2]), torch.tensor([1, -1]))
