"""EAGLE-2's tree as ``EagleDrafter`` grew it until 2026-11-28, a level at a time with the host choosing each level's
nodes: the reference the drafter's tree, grown on the device, is checked against (tests/drafters)."""
import math

import torch

from fuzzyspec.core.draft import Budget
from fuzzyspec.core.kvcache import crop_to

# (total nodes, depth, children a node): from one level, or one child a node, to wide and deep trees
TREE_SHAPES = [(8, 3, 2), (30, 6, 5), (16, 5, 4), (3, 1, 3), (6, 4, 1), (40, 4, 6)]


@torch.inference_mode()
def tree_level_by_level(drafter, sequence, shape, sampling):
    """EAGLE-2's tree as the drafter grew it until 2026-11-28, a level at a time with the host choosing each level's
    nodes (children of probability 0 left out): the reference. Returns its kept nodes' tokens, parents and q rows."""
    total, max_depth, top_k = shape
    hidden = drafter._root(sequence)
    base = drafter.cache.get_seq_length()
    root_q = sampling.probs(drafter._logits(hidden[:, -1])[0])
    tokens, parents, scores, depths, q_rows, row_of = [], [], [], [], [root_q], {}

    def add_children(expanded, probs, depth):
        values, ids = probs.topk(min(top_k, probs.shape[-1]))
        added = []
        for parent, row_values, row_ids in zip(expanded, values.double().tolist(), drafter._target_ids(ids).tolist()):
            for value, token in zip(row_values, row_ids):
                if value <= 0:
                    break
                added.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
                scores.append((scores[parent] if parent >= 0 else 0.0) + math.log(value))
                depths.append(depth)
        return added

    frontier, hidden_of, in_cache = add_children([-1], root_q[None], 1), {-1: hidden[0, -1]}, []
    for level in range(2, max_depth + 1):
        expand = sorted(frontier, key=lambda node: -scores[node])[:top_k]
        if not expand:
            break
        allowed = torch.zeros(len(expand), base + len(in_cache) + len(expand), dtype=torch.bool)
        allowed[:, :base] = True
        for row, node in enumerate(expand):
            ancestor = parents[node]
            while ancestor >= 0:
                allowed[row, base + in_cache.index(ancestor)] = True
                ancestor = parents[ancestor]
            allowed[row, base + len(in_cache) + row] = True
        out = drafter.step(drafter.cache, torch.tensor([[tokens[node] for node in expand]]),
                           torch.stack([hidden_of[parents[node]] for node in expand])[None],
                           torch.tensor([[base - 1 + depths[node] for node in expand]]), allowed[:, base:])[0]
        in_cache += expand
        probs = sampling.probs(drafter._logits(out))
        for row, node in enumerate(expand):
            hidden_of[node], row_of[node] = out[row], len(q_rows) + row
        q_rows += list(probs)
        frontier = add_children(expand, probs, level)
    crop_to(drafter.cache, base)
    kept = set(sorted(range(len(tokens)), key=lambda node: -scores[node])[:total])
    for node in list(kept):
        while parents[node] >= 0 and parents[node] not in kept:
            node = parents[node]
            kept.add(node)
    order = sorted(sorted(kept), key=lambda node: (depths[node], -scores[node]))
    blank = torch.zeros_like(root_q)
    return ([tokens[node] for node in order], [order.index(parents[node]) if parents[node] >= 0 else -1
                                               for node in order],
            torch.stack([root_q] + [q_rows[row_of[node]] if node in row_of else blank for node in order]))


def assert_grown_as_the_reference(make_drafter, prompt, features, shape, sampling):
    """Two drafters from ``make_drafter``, fed the same true ``features`` of ``prompt``: one's tree proposal, grown on
    the device, has the reference's tokens, parents and distributions (its shape on the device agreeing with its
    parents), and leaves its head's cache as long."""
    drafters = [make_drafter(), make_drafter()]
    for drafter in drafters:
        drafter.reset()
        drafter.observe(0, features)
    grown = drafters[0].propose(prompt, Budget(tokens=shape[1], tree=shape), sampling, None)
    tokens, parents, q = tree_level_by_level(drafters[1], prompt, shape, sampling)
    if grown.grown is not None:  # its shape on the device, read here, is the one the layout there was made from
        on_device = grown.grown
        grown.read_shape()
        assert on_device.ancestors.tolist() == grown.ancestors().tolist(), (shape, sampling)
        assert on_device.depths.tolist() == grown.depths and on_device.breadth == shape[2]
    assert grown.tokens.tolist() == tokens and grown.parents.tolist() == parents, (shape, sampling)
    assert torch.allclose(grown.q, q, atol=1e-6), (shape, sampling)
    assert drafters[0].cache.get_seq_length() == drafters[1].cache.get_seq_length()
