"""The tensor-parallel ranks of one engine: its worker processes (ranks 1..N-1), how rank 0 talks to them, and
the process group all its ranks share.

Rank 0 lives in the user's process and drives: each step's inputs go to every worker over a pipe, and all
ranks run the same forward (their layers meet in the all_reduces; notebook 14 counts them). nano-vllm does
this with shared memory and events inside model_runner.py; pipes are simpler and fast enough here.

Start-up is where a worker is most likely to die (an import that fails in the spawned process, an
out-of-memory error while loading). Rank 0 must never wait on a collective for a rank that is gone, so
every worker reports each start-up phase on its pipe (`checkpoint`), and rank 0 waits for those reports, watching
each worker's process, before it enters the next phase's collectives: a dead or failed worker ends the engine's
construction at once, with an error naming its rank and the phases it had done.

Each engine has a process group of its own over its ranks (`new_engine_group`), which the runner passes to the
parallel layers when it builds the model (notebook 04 explains their two all_reduces, notebook 05 the vocabulary
gather). Nothing here is process-wide: one process may hold several tensor-parallel engines."""

import multiprocessing.connection
import os
import socket
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.config import Config

TIMEOUT = timedelta(minutes=10)  # a rank that does not join (or answer) within this fails the collective

# + the rank: what `ps` and `top` show for a tensor-parallel worker instead of "python3" (the server names its
# processes alike); benchmarks/bench_serve.py reads the names to tell the engine's CPU time from the API server's
TP_WORKER = "minivllm-tp"


def set_process_name(name: str) -> None:
    """Linux: the process's name in /proc (at most 15 characters); elsewhere nothing."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


# --- the engine's process group ---


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
    if group is None or group.size() == 1:
        return n
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


# --- the worker processes ---


class WorkerError(RuntimeError):
    pass


class Workers:
    def __init__(self, config: Config, port: int, runner_class: type) -> None:
        """Spawn ranks 1..N-1, each building a `runner_class` (engine/model_runner.py's ModelRunner: rank 0 passes
        the class it builds, so that this module need not import the runner, which imports it)."""
        ctx = mp.get_context("spawn")
        self.processes, self.conns = [], []
        for rank in range(1, config.tensor_parallel_size):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=worker_main, args=(runner_class, config, rank, port, child), daemon=True)
            process.start()
            child.close()  # the worker holds its end: a dead worker makes recv() fail instead of wait
            self.processes.append(process)
            self.conns.append(parent)
        self.done = "nothing yet"  # the last start-up phase every worker reported (a pipe delivers in order)

    def send(self, method: str, arg) -> None:
        for conn in self.conns:
            conn.send((method, arg))

    def wait_for(self, phase: str) -> None:
        """Block until every worker reports `phase` done; raise WorkerError naming the first that died or
        failed instead."""
        waiting = dict(enumerate(self.conns, start=1))
        while waiting:
            sentinels = {self.processes[r - 1].sentinel: r for r in waiting}
            ready = multiprocessing.connection.wait(list(waiting.values()) + list(sentinels))
            for obj in ready:
                rank = sentinels.get(obj) or next(r for r, c in waiting.items() if c is obj)
                if rank not in waiting:
                    continue
                try:
                    kind, what, detail = waiting[rank].recv()
                except (EOFError, OSError):
                    process = self.processes[rank - 1]
                    process.join(timeout=5)  # reap it: its exit code is known only then
                    raise WorkerError(
                        f"tensor-parallel worker rank {rank} exited (exit code {process.exitcode}) before {phase}"
                        f"{main_hint()}"
                    ) from None
                if kind == "failed":
                    raise WorkerError(f"tensor-parallel worker rank {rank} failed (phases done: {self.done}): {detail}")
                assert (kind, what) == ("done", phase), f"worker rank {rank} reported {kind} {what}, expected {phase}"
                del waiting[rank]
        self.done = phase

    def exit(self, timeout: float = 30) -> None:
        for conn in self.conns:
            try:
                conn.send(("exit", None))
            except (BrokenPipeError, OSError):
                pass
        for p in self.processes:
            p.join(timeout=timeout)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []


def main_hint() -> str:
    """Why a spawned worker may die at once: it re-imports the parent's __main__ from its file, which a script
    read from standard input does not have."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path is not None and not os.path.isfile(path):
        return f"; spawned workers re-import __main__, which is not a file here ({path!r}): run the script from a file"
    return " (its error is printed above)"


def worker_main(runner_class: type, config: Config, rank: int, port: int, conn) -> None:
    """A tensor-parallel worker: build its ModelRunner (`runner_class`), then run whatever rank 0 sends until it says
    exit or goes away."""
    set_process_name(f"{TP_WORKER}{rank}")
    try:
        runner = runner_class(config, rank=rank, port=port, reporter=conn)  # it reports each phase done on `conn`
    except BaseException as e:
        detail = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        try:
            conn.send(("failed", None, detail))
        except (BrokenPipeError, OSError):
            pass
        raise
    try:
        while True:
            try:
                method, arg = conn.recv()
            except (EOFError, OSError):  # the driver is gone
                break
            if method == "exit":
                break
            getattr(runner, method)(arg)
    finally:
        runner.exit()
