"""Tensor-parallel helpers: this process's rank and world size, divisibility checks, and the process group
of one engine (notebook 04 explains the two all_reduces per layer, notebook 05 the vocabulary gather)."""

import socket
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _update_default_pg, _world


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"tensor parallel size {denominator} does not divide {what} {numerator}")
    return numerator // denominator


def free_port() -> int:
    """A TCP port free right now on localhost (no fixed port: two engines on one host must coexist)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world_size: int, port: int, backend: str | None = None) -> None:
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    if backend == "nccl":
        torch.cuda.set_device(rank)


# --- one engine's group ------------------------------------------------------------------------------
# torch.distributed has one default group per process, and the layers call `dist.all_reduce(x)` on it
# (nano-vllm's layers do too). A worker process serves one engine, but the driver (rank 0) may hold several
# TP engines at once, so each engine's group is the default only while that engine runs a step.


def new_engine_group(rank: int, world_size: int, port: int, backend: str) -> dist.ProcessGroup:
    """Join this engine's group and return it, leaving no default group behind on rank 0. The group's name
    (its key prefix in the store) must be equal on every rank and distinct per engine: the port is both."""
    _update_default_pg(None)
    _world.group_count = port
    init_process_group(rank, world_size, port, backend)
    group = dist.group.WORLD
    if rank == 0:
        _update_default_pg(None)
    return group


@contextmanager
def engine_group(group: dist.ProcessGroup | None):
    """`with engine_group(g):` the layers' collectives go to `g` (no-op for None, a single-process engine)."""
    if group is None:
        yield
        return
    previous = _world.default_pg
    _update_default_pg(group)
    try:
        yield
    finally:
        _update_default_pg(previous)


def destroy_engine_group(group: dist.ProcessGroup) -> None:
    """Destroy this engine's group only, never another engine's."""
    if dist.group.WORLD is group:
        _update_default_pg(None)
    dist.destroy_process_group(group)


def min_over_ranks(n: int, device: torch.device) -> int:
    """The smallest `n` over the tensor-parallel ranks of the current group (`n` itself with one rank)."""
    if tp_size() == 1:
        return n
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
