"""Run a function in several gloo processes, one per tensor-parallel rank (tests/test_tp.py, notebooks 04,
05 and 14). The function must be importable (a module-level function), its result picklable. Each process joins
torch.distributed's default group, which the layers it builds get as their `group` (tp_common.group())."""

import os
import pickle
import sys

import torch
import torch.distributed as dist

from minivllm.engine.tp_workers import free_port


def _spawn_entry(rank: int, world_size: int, port: int, fn, args, queue, group: bool) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        queue.put((rank, pickle.dumps(result)))  # by value: torch would share tensors through this
        # process's fds, gone once it exits
        if group:
            dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        if group:
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip C++ static destructors: at interpreter exit a leftover thread aborted the process
    # ("terminate called without an active exception") in about one notebook run in five


def run_tp(fn, world_size: int = 2, args: tuple = (), group: bool = True) -> list:
    """Run `fn(rank, world_size, *args)` in `world_size` gloo processes; return each rank's result in
    rank order. `fn` must be importable (a module-level function), results picklable. `group=False` leaves
    the process group to `fn` (a ModelRunner joins its engine's own group)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    context = mp.start_processes(
        _spawn_entry,
        args=(world_size, free_port(), fn, args, queue, group),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    results = {}
    while len(results) < world_size:  # read while they run: a large result would fill the pipe
        if not queue.empty():
            rank, data = queue.get()
            results[rank] = pickle.loads(data)
        else:
            context.join(timeout=0.05)  # raises if a process failed
    while not context.join():
        pass
    return [results[r] for r in range(world_size)]
