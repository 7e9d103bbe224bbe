"""Tensor-parallel helpers: a rank and world size read from a process group, divisibility checks, and the
process group of one engine (notebook 04 explains the two all_reduces per layer, notebook 05 the vocabulary
gather). The runner makes its engine's group and passes it to the parallel layers when it builds the model; they
call `dist.all_reduce(y, group=self.group)`. Nothing here is process-wide: the driver process may hold several
tensor-parallel engines, each with its own group, and a worker process serves one."""

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT = timedelta(minutes=10)  # a rank that does not join (or answer) within this fails the collective


def tp_rank(group: dist.ProcessGroup | None = None) -> int:
    return group.rank() if group is not None else 0


def tp_size(group: dist.ProcessGroup | None = None) -> int:
    return group.size() if group is not None else 1


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"tensor parallel size {denominator} does not divide {what} {numerator}")
    return numerator // denominator


def free_port() -> int:
    """A TCP port free right now on localhost (no fixed port: two engines on one host must coexist)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_engine_group(rank: int, world_size: int, port: int, backend: str) -> dist.ProcessGroup:
    """This engine's group over its `world_size` ranks, met at `port` on localhost (rank 0 holds the store): a
    process group of its own, not torch.distributed's default one, so one process can hold several engines'."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=TIMEOUT)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)


def destroy_engine_group(group: dist.ProcessGroup) -> None:
    """Close this engine's group only, never another engine's. (Gloo's groups have `shutdown` from torch 2.7 on;
    before, their connections close when the last reference goes.)"""
    if hasattr(group, "shutdown"):
        group.shutdown()


def min_over_ranks(n: int, device: torch.device, group: dist.ProcessGroup | None = None) -> int:
    """The smallest `n` over the tensor-parallel ranks of `group` (`n` itself with one rank)."""
    if tp_size(group) == 1:
        return n
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
