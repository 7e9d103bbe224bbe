"""The engine-core process and the two sockets an API server's client holds to it (core_client.py): ZeroMQ IPC
sockets in a private temporary directory (PUSH to the core, PULL from it, both without a high-water mark so that
neither side ever waits for the other to read). The API server binds them; the core connects.

Two ways to have a core:
- `CoreProcess`: `minivllm serve` with one API server. It spawns the core itself (multiprocessing; the entry
  point, core.run_engine_core, lives in the package), watches it through its process sentinel, stops it and
  removes the directory.
- `AttachedCore`: one of N API-server processes (api_servers.py). The parent started the core and owns the
  directory; this API server binds its own pair (`client_addresses(dir, i)`) and watches the core through a pidfd,
  which, like a sentinel, becomes readable when the process ends, also for a process that is not its child."""

import multiprocessing as mp
import os
import select
import shutil
import tempfile
import time

import zmq

from minivllm.serve import messages as m
from minivllm.serve.core import run_engine_core

START_TIMEOUT = 1800.0  # a GPU engine profiles memory and captures CUDA graphs before it is ready


def client_addresses(ipc_dir: str, index: int) -> tuple[str, str]:
    """API server `index`'s (input, output) socket addresses: what it sends to the core, what it reads back."""
    return f"ipc://{ipc_dir}/input-{index}", f"ipc://{ipc_dir}/output-{index}"


def spawn_core(model: str, engine_args: dict, ipc_dir: str, num_clients: int) -> mp.Process:
    """Start the engine core for `num_clients` API servers; it exits when this process is gone."""
    clients = [client_addresses(ipc_dir, i) for i in range(num_clients)]
    process = mp.get_context("spawn").Process(
        target=run_engine_core, args=(model, engine_args, clients, os.getpid()), name="minivllm-engine-core"
    )
    process.start()
    return process


class CoreSockets:
    """An API server's pair of sockets to the core; subclasses say how the core's death is seen (`sentinel`)."""

    sentinel: int  # a file descriptor readable once the core process has ended

    def __init__(self, ipc_dir: str, index: int) -> None:
        self.ipc_dir = ipc_dir
        inp, out = client_addresses(ipc_dir, index)
        self.ctx = zmq.Context()
        self.input, self.output = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.input.bind(inp)
        self.output.bind(out)
        self.enc, self.dec = m.encoder(), m.decoder(m.FromCore)

    def alive(self) -> bool:
        return not select.select([self.sentinel], [], [], 0)[0]

    def exit_reason(self) -> str:
        return "core process exited"

    def wait_ready(self) -> m.Ready:
        """The core's Ready message; RuntimeError with the core's reason when it could not start."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.output.poll(100):
                ready = self.dec.decode(self.output.recv())
                if ready.error is not None:
                    raise RuntimeError(f"the engine core failed to start: {ready.error}")
                return ready
            if not self.alive():
                raise RuntimeError(f"the engine {self.exit_reason()} at start")
        raise RuntimeError(f"the engine core was not ready in {START_TIMEOUT:.0f} s")

    def send(self, msg) -> None:
        """Send to the core. Without a peer (the core died) the message is dropped: the client's output thread
        sees the death (the sentinel) and ends every stream."""
        try:
            self.input.send(self.enc.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()


class CoreProcess(CoreSockets):
    """The core of a server with one API server: started, stopped and cleaned up here."""

    owned = True  # shutting the client down stops the core

    def __init__(self, model: str, engine_args: dict) -> None:
        super().__init__(tempfile.mkdtemp(prefix="minivllm-core-"), 0)
        self.process = spawn_core(model, engine_args, self.ipc_dir, 1)
        self.sentinel = self.process.sentinel

    def exit_reason(self) -> str:
        self.process.join(1)
        return f"core process exited with code {self.process.exitcode}"

    def stop(self, timeout: float = 60) -> None:
        """Ask the core to stop (it aborts its requests, stops its TP workers and exits); wait for it, then
        terminate or kill it if it does not."""
        if self.process.is_alive():
            self.send(m.Shutdown())
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


class AttachedCore(CoreSockets):
    """The core of a server with several API servers, as API server `index` sees it: the parent started it and
    stops it (api_servers.py); this one only talks to it and watches it."""

    owned = False

    def __init__(self, ipc_dir: str, index: int, core_pid: int) -> None:
        self.sentinel = os.pidfd_open(core_pid)  # (ProcessLookupError: the core is gone already)
        super().__init__(ipc_dir, index)

    def stop(self, timeout: float = 60) -> None:
        pass  # the parent stops the core once every API server has left

    def close(self) -> None:
        super().close()
        os.close(self.sentinel)
