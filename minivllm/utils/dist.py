"""Tensor-parallel helpers: this process's rank and world size, divisibility checks, and process groups
for tests and notebooks (gloo on CPU). Functions run by spawned processes must live in a module, not in a
notebook cell, so they are here."""
import os
import pickle
import socket
import sys

import torch
import torch.distributed as dist


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


def _spawn_entry(rank: int, world_size: int, port: int, fn, args, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    init_process_group(rank, world_size, port, "gloo")
    try:
        result = fn(rank, world_size, *args)
        queue.put((rank, pickle.dumps(result)))      # by value: torch would share tensors through this
                                                     # process's fds, gone once it exits
        dist.barrier()                               # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)     # skip C++ static destructors: at interpreter exit a leftover thread aborted the process
                    # ("terminate called without an active exception") in about one notebook run in five


def run_tp(fn, world_size: int = 2, args: tuple = ()) -> list:
    """Run `fn(rank, world_size, *args)` in `world_size` gloo processes; return each rank's result in
    rank order. `fn` must be importable (a module-level function), results picklable."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    context = mp.start_processes(_spawn_entry, args=(world_size, free_port(), fn, args, queue),
                                 nprocs=world_size, join=False, start_method="spawn")
    results = {}
    while len(results) < world_size:         # read while they run: a large result would fill the pipe
        if not queue.empty():
            rank, data = queue.get()
            results[rank] = pickle.loads(data)
        else:
            context.join(timeout=0.05)       # raises if a process failed
    while not context.join():
        pass
    return [results[r] for r in range(world_size)]
