"""Compiled steps kept on disk (``core.kept``): loaded by a later process instead of compiled, one graph for every
cache capacity, and never a graph made from something else."""
import os
import time

import pytest
import torch

from conftest import run_step as run, tiny_llama
from fuzzyspec.core import kept
from fuzzyspec.core.kept import Kept, fingerprint, structure
from fuzzyspec.core.kvcache import StaticCache
from fuzzyspec.core.step import TargetStep


@pytest.fixture()
def folder(monkeypatch, tmp_path):
    monkeypatch.setattr(kept, "folder", lambda: tmp_path)
    return tmp_path


def answer(step: TargetStep, capacity: int = 16, grow_to: int | None = None) -> list[torch.Tensor]:
    """The logits of a prompt's prefill (eager) and two compiled one-token steps, the cache grown in between."""
    cache = StaticCache.for_model(step.model.config, 1, capacity, torch.float32, "cpu")
    out = []
    with torch.inference_mode():
        run(step, cache, [[3, 9, 4]])
        cache.lengths = [3]
        out.append(run(step, cache, [[6]], compiled=True)[0])
        if grow_to is not None:
            cache.grow(capacity=grow_to)
        cache.lengths = [4]
        out.append(run(step, cache, [[11]], compiled=True)[0])
    return out


def test_a_later_process_loads_the_kept_graph_instead_of_compiling(folder, monkeypatch):
    model = tiny_llama(seed=3)
    first = TargetStep(model, compile=True)
    expected = answer(first)
    assert isinstance(first._compiled, Kept) and len(list(folder.rglob("*.bin"))) == 1

    def refuse(*_):
        raise AssertionError("compiled again")
    monkeypatch.setattr(Kept, "_compile", refuse)
    later = TargetStep(model, compile=True)  # (a new step knows no graph: as a new process)
    noticed = []
    later.on_compile = lambda rows, width: noticed.append((rows, width))
    for got, want in zip(answer(later), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert noticed == []  # loading is not announced as a compilation


def test_one_kept_graph_serves_every_capacity(folder):
    model = tiny_llama(seed=3)
    step = TargetStep(model, compile=True)
    compiled = answer(step, capacity=16, grow_to=64)
    assert len(step._compiled.calls) == 1 and not step._compiled.compiling  # the second call, at 64, compiled nothing
    eager = answer(TargetStep(model), capacity=16, grow_to=64)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_kept_graph_that_does_not_load_is_compiled_anew(folder):
    model = tiny_llama(seed=3)
    expected = answer(TargetStep(model, compile=True))
    for path in folder.rglob("*.bin"):
        path.write_bytes(b"cut short")
    again = TargetStep(model, compile=True)
    for got, want in zip(answer(again), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert all(path.stat().st_size > 1000 for path in folder.rglob("*.bin"))  # (replaced)


def test_graphs_are_kept_apart_by_the_models_structure_not_its_weights():
    same = fingerprint(structure(tiny_llama(seed=3)))
    assert fingerprint(structure(tiny_llama(seed=4))) == same  # other weights: the graph reads them as inputs
    assert fingerprint(structure(tiny_llama(seed=3, layers=3))) != same
    assert fingerprint(structure(tiny_llama(seed=3, hidden=48))) != same
    assert fingerprint(structure(tiny_llama(seed=3)), "another function") != same


def test_a_target_that_cannot_be_compiled_ahead_warns_once_and_runs_through_dynamo(folder, monkeypatch):
    model = tiny_llama(seed=3)

    def fail(*_):
        raise RuntimeError("aot_compile is missing")
    monkeypatch.setattr(Kept, "_compile", fail)
    step = TargetStep(model, compile=True)
    with pytest.warns(UserWarning, match=r"the target's step could not be compiled ahead \(RuntimeError: "
                                         r"aot_compile is missing\)") as warned:
        compiled = answer(step, capacity=16, grow_to=64)
    assert len(warned) == 1 and not isinstance(step._compiled, Kept)
    for got, want in zip(compiled, answer(TargetStep(model), capacity=16, grow_to=64)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_graphs_no_process_used_for_a_month_are_deleted_and_a_loaded_one_counts_as_used(folder):
    model = tiny_llama(seed=3)
    answer(TargetStep(model, compile=True))
    (graph,) = folder.rglob("*.bin")
    stale = folder / "another model" / "0123.bin"
    stale.parent.mkdir()
    stale.write_bytes(b"an old graph")
    long_ago = time.time() - (kept.UNUSED_DAYS + 1) * 86400
    for path in (graph, stale):
        os.utime(path, (long_ago, long_ago))
    answer(TargetStep(model, compile=True))  # (a new step: it loads the graph)
    assert kept.prune() == [stale] and not stale.parent.exists()
    assert graph.is_file() and graph.stat().st_mtime > long_ago
    assert kept.prune(days=0) == [graph]  # (unused since that load)


def test_one_kept_graph_serves_every_count_of_spare_slots(folder, monkeypatch):
    """A server's cache holds every row it has seated, and a step runs over its first rows: one graph serves a
    cache of any number of slots beyond the step's rows (and another a cache of exactly its rows), in this process
    and, loaded, in a later one."""
    model = tiny_llama(seed=3)
    eager = TargetStep(model)

    def outputs(step, rows, slots):
        got = []
        with torch.inference_mode():
            for runner, compiled in ((step, True), (eager, False)):
                cache = StaticCache.for_model(model.config, slots, 16, torch.float32, "cpu")
                run(runner, cache, [[3, 9, 4]] * rows)
                cache.lengths = [3] * rows + [0] * (slots - rows)
                got.append(run(runner, cache, [[6]] * rows, compiled=compiled)[0])
        return got

    step = TargetStep(model, compile=True)
    noticed = []
    step.on_compile = lambda rows, width: noticed.append((rows, width))
    for rows, slots in ((1, 1), (1, 2), (1, 5), (2, 2), (2, 3), (2, 8), (1, 3)):
        torch.testing.assert_close(*outputs(step, rows, slots), rtol=1e-4, atol=1e-4)
    assert len(step._compiled.calls) == 4 and noticed == [(1, 1), (1, 1), (2, 1), (2, 1)]

    def refuse(*_):
        raise AssertionError("compiled again")
    monkeypatch.setattr(Kept, "_compile", refuse)
    later = TargetStep(model, compile=True)
    for rows, slots in ((1, 7), (2, 6)):
        torch.testing.assert_close(*outputs(later, rows, slots), rtol=1e-4, atol=1e-4)


def test_a_deferred_call_runs_eagerly_and_its_graph_compiles_when_asked(folder):
    """A server's step (``defer``) answers a call whose graph is not ready eagerly, the same logits as an eager
    step, and compiles that graph only when asked (while the server is idle); the next such call runs it."""
    model = tiny_llama(seed=3)
    step, eager = TargetStep(model, compile=True), TargetStep(model)
    step.defer = True

    def outputs(runner, compiled):
        with torch.inference_mode():
            cache = StaticCache.for_model(model.config, 3, 16, torch.float32, "cpu")
            run(runner, cache, [[3, 9, 4]] * 2)
            cache.lengths = [3, 3, 0]
            got = run(runner, cache, [[6, 2]] * 2, compiled=compiled)[0]
        return got, runner.compiling
    want, _ = outputs(eager, False)
    got, compiling = outputs(step, True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert compiling and len(step.deferred) == 1 and step._compiled.calls == {}  # (its time is not a step's)
    assert step.compile_deferred() and not step.deferred and len(step._compiled.calls) == 1
    got, compiling = outputs(step, True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not compiling and not step.deferred and not step.compile_deferred()
