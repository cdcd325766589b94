"""CUDA graphs captured around a compiled step by our own hand, and replayed with nothing but a copy of the inputs.

Why not inductor's "reduce-overhead" mode: its CUDA graph trees do their bookkeeping in Python on every call, after
dynamo's own cache lookup: checking each input's address and copying it, marking steps, tracking which outputs are
still alive. On an H100 machine's host that came to 0.6 ms a target call, against a 1.5 ms replay of the same
forward captured by hand (``benchmarks/profile_gpu.py``, parts 3 and 4, 2026-11-26); a one-layer EAGLE head's call
paid the same for far less work. Here a known call is one ``_foreach_copy_`` and one ``cudaGraphLaunch``.

A call's tensors are of two kinds:

- **lasting**: those that keep their address from call to call, which a graph reads and writes in place: a tensor
  marked with ``torch._dynamo.mark_static_address`` (``kvcache._static``: every cache tensor), and every tensor of
  an argument that holds ``keys`` and ``values`` lists of them (``kvcache.StaticCache``);
- **moving**: every other tensor argument (tokens, positions, masks, features), copied into the graph's own input
  buffers before each replay.

A graph is captured per the caller's key (shapes, dtypes, Python values: what tells the compiled function's graphs
apart) and per the lasting tensors' addresses: a cache reallocated (grown, or another engine's) gets a graph of its
own, and a graph whose lasting tensors are gone is dropped. A replay's outputs live in the graph's memory, which its
next replay overwrites: a caller copies what it keeps.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

# Counts of calls not captured yet (``Graphs.met``) kept at most. Their keys hold addresses, which cannot tell a dead
# cache's from a live one at the same address, so they are never pruned one by one: past this many (a long-running
# server's caches come and go) they start again, which at worst delays a capture by ``patience`` calls.
MET_LIMIT = 4096


def lasting(tensor: Tensor) -> bool:
    """Whether ``tensor`` is marked as keeping its address (``torch._dynamo.mark_static_address``)."""
    return getattr(tensor, "_dynamo_static_input_type", None) is not None


def split(arguments: tuple) -> tuple[list[int], list[Tensor]]:
    """The places of a call's moving tensors among ``arguments``, and its lasting tensors (see the module
    docstring). Tensors nested in other containers are refused: a graph would read them at their captured address
    whatever the caller passed next."""
    moving: list[int] = []
    kept: list[Tensor] = []
    for place, argument in enumerate(arguments):
        if isinstance(argument, Tensor):
            if lasting(argument):
                kept.append(argument)
            else:
                moving.append(place)
        elif hasattr(argument, "keys") and hasattr(argument, "values") and isinstance(argument.keys, list):
            kept += [*argument.keys, *argument.values]
        elif isinstance(argument, (list, tuple, dict)) and any(isinstance(item, Tensor) for item in (
                argument.values() if isinstance(argument, dict) else argument)):
            raise TypeError("a captured call takes its tensors as arguments of their own, or in a cache")
    return moving, kept


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[Tensor]  # the graph's own copies of the moving tensors
    outputs: Any  # what the captured call returned: its tensors live in the graph's memory
    alive: list[weakref.ref]  # the lasting tensors it reads and writes


class Graphs:
    """A compiled step's calls, run through CUDA graphs captured per key and lasting addresses (see the module
    docstring)."""

    def __init__(self, warm_up: bool = True, patience: int = 0) -> None:
        """``warm_up``: run a call once before capturing it (a compiled function compiles there); not for a call
        that reads what it writes, which the capture's replay would then do twice. ``patience``: how many calls of a
        key (over the same lasting tensors) a caller makes its own way (``ready``) before one is captured."""
        self.warm_up = warm_up
        self.patience = patience
        self.captured: dict[tuple, Captured] = {}
        self.met: dict[tuple, int] = {}  # calls not captured yet, by address (``ready``)

    @staticmethod
    def _address(key: tuple, arguments: tuple) -> tuple[tuple, list[int], list[Tensor]]:
        moving, kept = split(arguments)
        # (shapes too: a cache of another size may be given a freed one's address)
        address = (key, tuple(tensor.data_ptr() for tensor in kept), kept[0].shape if kept else None,
                   tuple((arguments[place].shape, arguments[place].dtype) for place in moving))
        return address, moving, kept

    def ready(self, key: tuple, arguments: tuple) -> bool:
        """Whether a call of ``key`` over ``arguments`` is to go through a graph: one is captured, or its key has
        been met ``patience`` times (then this call captures it). A capture costs more than a call (a run to warm
        up, a wait for the device, the graph's instantiation), which a shape met once or twice never repays: an
        EAGLE-2 tree of a size the planner tries now and then."""
        address = self._address(key, arguments)[0]
        if address in self.captured:
            return True
        if len(self.met) >= MET_LIMIT and address not in self.met:
            self.met.clear()
        self.met[address] = self.met.get(address, 0) + 1
        return self.met[address] > self.patience

    def __call__(self, key: tuple, function: Callable, arguments: tuple) -> tuple[Any, bool]:
        """``function(*arguments)``'s result, read from a replay, and whether this call captured a graph (and so
        compiled, or at least ran ``function`` twice: its time is not a step's). ``key``: what tells the compiled
        ``function``'s graphs apart (shapes, dtypes, Python values)."""
        address, moving, kept = self._address(key, arguments)
        captured = self.captured.get(address)
        fresh = captured is None
        if fresh:
            captured = self.captured[address] = self._capture(function, arguments, moving, kept)
            self.met.pop(address, None)  # (counted no more: captured)
        torch._foreach_copy_(captured.inputs, [arguments[place] for place in moving])
        captured.graph.replay()
        return captured.outputs, fresh

    def _capture(self, function: Callable, arguments: tuple, moving: list[int], kept: list[Tensor]) -> Captured:
        # A first run outside the capture, on a side stream as CUDA's capture rules ask: it compiles where needed,
        # and the kernels' first calls (cuBLAS choosing its algorithms, workspaces) happen there. It writes what
        # the replay below writes again, at the same places.
        stream = _side_stream()
        if self.warm_up:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                function(*arguments)
            torch.cuda.current_stream().wait_stream(stream)
        inputs = [arguments[place].clone() for place in moving]
        own = list(arguments)
        for place, tensor in zip(moving, inputs):
            own[place] = tensor
        # Captured on a side stream after a wait for the device, as ``torch.cuda.graph`` does, but without emptying
        # PyTorch's caches of device memory and of pinned host memory as it does next. Inside an answer (a tree shape
        # grown a third time, a grown cache) that left the steps after it to allocate afresh until the caches
        # filled again: device memory, and pinned host memory, which every ``upload`` takes and is dear to allocate.
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            graph.capture_begin()
            try:
                outputs = function(*own)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        self.captured = {address: old for address, old in self.captured.items()
                         if all(ref() is not None for ref in old.alive)}
        return Captured(graph, inputs, outputs, [weakref.ref(tensor) for tensor in kept])


_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    """The side stream warm-ups and captures run on, one per device for every ``Graphs``: a warm-up on the stream its
    capture then runs on sets up what the kernels need on that stream (cuBLAS's handle and workspace) outside it."""
    device = torch.cuda.current_device()
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream()
    return _STREAMS[device]
