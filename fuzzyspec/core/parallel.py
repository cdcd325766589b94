"""A tensor-parallel target: every rank of a ``torchrun`` launch holds a shard and runs the same steps.

transformers shards the target with its own tensor-parallel plan (``tp_plan="auto"``): each linear
layer keeps a slice of its weights and the plan's hooks all-reduce or all-gather between layers, so the
logits and hidden states every rank sees are the same. Drafters are small and run replicated on every
rank. For the ranks to stay in lockstep, every decision must come out the same everywhere: the rules
and drafts follow from the same numbers, and the host-side choices that do not (a seed left to chance,
draft sizes planned from each rank's own timings, rows that a stop callback on rank 0 ends) are rank 0's,
broadcast (``agree``). Rank 0 alone prints, streams and serves; a sharded server's other ranks follow what
rank 0 does to its batch (``serve.scheduler``).

A rank that dies makes its peers' next collective fail, and a peer that hangs makes them fail after
``TIMEOUT_S``: either way every rank ends with one line (``ParallelError``), never a hang.
"""
from __future__ import annotations

import datetime
import os
import sys
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
TIMEOUT_S = float(os.environ.get("FUZZYSPEC_TP_TIMEOUT_S", "120"))  # longest wait in a collective


class ParallelError(RuntimeError):
    """A rank failed or a collective timed out: the job ends on every rank."""


def world_size() -> int:
    """How many processes the launch started (1 outside ``torchrun``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched() -> bool:
    """Whether this process is one of several started by ``torchrun`` (or set up as such)."""
    return world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def local_device(device: str) -> str:
    """This rank's device: its own GPU (``LOCAL_RANK``) on CUDA, the CPU otherwise."""
    if device.startswith("cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


def start(device: str) -> None:
    """Join the launch's process group (gloo on the CPU, nccl on GPUs) with a bounded wait per collective."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_device(device))
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    except (RuntimeError, ValueError) as error:
        raise ParallelError(f"the tensor-parallel launch did not come together: {_first_line(error)}") from error


def shards(model: torch.nn.Module) -> int:
    """How many ranks share ``model``'s weights: the size of its tensor-parallel mesh, else 1."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor can exist, and importing it takes 0.7 s
        return 1
    from torch.distributed.tensor import DTensor

    weight = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    return weight.device_mesh.size() if weight is not None else 1


def agree(values: T) -> T:
    """Rank 0's ``values`` on every rank (every rank calls it at the same point; what the others pass is
    replaced)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    box = [values]
    try:
        dist.broadcast_object_list(box, src=0)
    except RuntimeError as error:  # gloo's and nccl's errors for a dead or silent peer
        raise ParallelError(f"a tensor-parallel rank failed or timed out: {_first_line(error)}") from error
    return box[0]


def describe(error: BaseException) -> str:
    """One line for an error a collective raised (or ``ParallelError``'s own)."""
    if isinstance(error, ParallelError):
        return str(error)
    return f"a tensor-parallel rank failed or timed out: {_first_line(error)}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
