"""Traffic between the host and the device, kept off the critical path.

On a GPU every read of a device value by Python (``.tolist()``, ``int(t)``, ``bool(t)``) waits for all
queued work, and so does a plain copy of host data to the device (PyTorch synchronises the stream after
a blocking host-to-device copy). The engine reads the device once per step, for the acceptance outcome;
everything it sends goes through ``upload``, and its timings through ``DeviceTimer``, neither of which
waits. On the CPU both are the plain operations.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import Tensor


def upload(values: list | Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """Host data (a list, or a CPU tensor) as a tensor on ``device``, copied without waiting for the device:
    staged in pinned memory, which an asynchronous copy needs to stay asynchronous. A tensor on the device already
    is returned as it is."""
    tensor = values if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    device = torch.device(device)
    if device.type == "cpu" and tensor.device.type == "cpu":  # (as ``to`` would: without a call, cold after a pass)
        return tensor
    if device.type != "cuda" or tensor.device.type == "cuda":  # (there already: nothing to stage)
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class DeviceTimer:
    """Milliseconds that pieces of device work took, reported once known, without waiting for them.

    ``start()`` marks the beginning of a piece, ``stop(mark, report)`` its end; ``report(ms)`` is called
    then on the CPU, and on CUDA at a later ``flush()`` once the device has passed the end (the engine
    flushes after its per-step read, by which point every piece it timed has finished)."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event, Callable[[float], None]]] = []

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, mark, report: Callable[[float], None]) -> None:
        if not self.cuda:
            report(1000 * (time.perf_counter() - mark))
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((mark, end, report))

    def flush(self) -> None:
        waiting = []
        for begin, end, report in self.pending:
            if end.query():
                report(begin.elapsed_time(end))
            else:
                waiting.append((begin, end, report))
        self.pending = waiting
