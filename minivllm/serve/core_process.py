"""The engine-core process and its two sockets, as the API server's client holds them (core_client.py):
spawned with multiprocessing (its entry point, core.run_engine_core, lives in the package), connected over
ZeroMQ IPC sockets in a private temporary directory (PUSH to the core, PULL from it, both without a
high-water mark so that neither side ever waits for the other to read), stopped and cleaned up."""

import multiprocessing as mp
import os
import shutil
import tempfile
import time

import zmq

from minivllm.serve import messages as m
from minivllm.serve.core import run_engine_core

START_TIMEOUT = 1800.0  # a GPU engine profiles memory and captures CUDA graphs before it is ready


class CoreProcess:
    def __init__(self, model: str, engine_args: dict) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="minivllm-core-")
        inp, out = f"ipc://{self.ipc_dir}/input", f"ipc://{self.ipc_dir}/output"
        self.ctx = zmq.Context()
        self.input, self.output = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.input.bind(inp)
        self.output.bind(out)
        self.enc, self.dec = m.encoder(), m.decoder(m.FromCore)
        self.process = mp.get_context("spawn").Process(
            target=run_engine_core, args=(model, engine_args, inp, out, os.getpid()), name="minivllm-engine-core"
        )
        self.process.start()

    def wait_ready(self) -> m.Ready:
        """The core's Ready message; RuntimeError with the core's reason when it could not start."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.output.poll(100):
                ready = self.dec.decode(self.output.recv())
                if ready.error is not None:
                    raise RuntimeError(f"the engine core failed to start: {ready.error}")
                return ready
            if not self.process.is_alive():
                raise RuntimeError(f"the engine core process exited with code {self.process.exitcode} at start")
        raise RuntimeError(f"the engine core was not ready in {START_TIMEOUT:.0f} s")

    def send(self, msg) -> None:
        """Send to the core. Without a peer (the core died) the message is dropped: the client's output thread
        sees the death (the process sentinel) and ends every stream."""
        try:
            self.input.send(self.enc.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

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
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
