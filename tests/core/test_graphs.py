"""Which of a captured call's tensors are copied in before each replay, and which it keeps reading in place.
(Capture and replay themselves need a GPU: benchmarks/cuda_check.py checks them against eager steps.)"""
import pytest
import torch

from fuzzyspec.core import graphs as graphs_module
from fuzzyspec.core.graphs import Graphs, split
from fuzzyspec.core.kvcache import StaticCache


def _marked(tensor: torch.Tensor) -> torch.Tensor:
    torch._dynamo.mark_static_address(tensor)
    return tensor


def test_a_caches_tensors_last_and_a_steps_inputs_move():
    cache = StaticCache(2, kv_heads=1, head_dim=4, slots=1, capacity=8, dtype=torch.float32, device="cpu")
    keys, values = _marked(torch.zeros(1, 8)), _marked(torch.zeros(1, 8))
    tokens, mask = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 1, 2, 8, dtype=torch.bool)
    moving, kept = split((cache, tokens, None, 3, (0, 1), mask))
    assert moving == [1, 5]
    assert [t.data_ptr() for t in kept] == [t.data_ptr() for t in (*cache.keys, *cache.values)]
    moving, kept = split((keys, values, tokens, mask))
    assert moving == [2, 3] and kept[0] is keys and kept[1] is values


def test_a_tensor_hidden_in_a_container_is_refused():
    with pytest.raises(TypeError, match="arguments of their own"):
        split((torch.zeros(1), [torch.zeros(2)]))
    with pytest.raises(TypeError):
        split(({"x": torch.zeros(1)},))
    assert split(((1, 2), [3], {"a": 1})) == ([], [])


def test_a_key_goes_through_a_graph_from_the_call_after_its_patience():
    """A shape met now and then is not worth a capture: with ``patience`` 2, the first two calls of a key over the
    same lasting tensors are the caller's own, the third on go through a graph; another cache, or another key or
    input shape, counts apart."""
    graphs = Graphs(patience=2)
    keys, other = _marked(torch.zeros(1, 8)), _marked(torch.zeros(1, 8))
    hidden = torch.zeros(1, 1, 4)
    assert [graphs.ready(("tree", 3), (hidden, keys)) for _ in range(4)] == [False, False, True, True]
    assert not graphs.ready(("tree", 3), (hidden, other))
    assert not graphs.ready(("tree", 4), (hidden, keys))
    assert not graphs.ready(("tree", 3), (torch.zeros(1, 2, 4), keys))
    assert Graphs().ready(("tree", 3), (hidden, keys))


def test_the_counts_of_calls_not_captured_stay_bounded(monkeypatch):
    """A server's caches come and go, each counted by its address until its key is captured: past ``MET_LIMIT``
    counts they start again (a capture comes ``patience`` calls later, never sooner), so they cannot grow without
    end."""
    monkeypatch.setattr(graphs_module, "MET_LIMIT", 3)
    graphs = Graphs(patience=1)
    hidden = torch.zeros(1, 1, 4)
    caches = [_marked(torch.zeros(1, 8)) for _ in range(7)]
    first = caches[0]
    assert not graphs.ready(("tree", 3), (hidden, first))
    for cache in caches[1:]:
        assert not graphs.ready(("tree", 3), (hidden, cache))
        assert len(graphs.met) <= 3
    assert not graphs.ready(("tree", 3), (hidden, first))  # its count started again
    assert graphs.ready(("tree", 3), (hidden, first))
