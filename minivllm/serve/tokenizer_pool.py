"""Tokenising, chat templates and detokenising off the server's event loop: a small pool of processes, each
with its own copy of the tokenizer (vLLM's front end keeps this work off its loop too), supervised.

Why processes and not threads: the fast tokenizer releases the GIL while it splits the text, but turning
its ids into a Python list holds it; a 5 MB prompt (~4 million ids) on two cores kept the loop from running
for ~0.5 s in a thread, ~9 s inline. In another process nothing of it touches the loop's GIL, and a prompt
longer than the model can take is refused there: its ids never travel back.

Why not concurrent.futures' process pool: one worker killed (as the kernel's out-of-memory killer does) breaks
that pool for good, and fails every job of every worker. Here each worker has a thread of the server that hands it
one job at a time over a pipe and waits for the answer or for the worker's death: a dead worker fails only the job
it held (WorkerDiedError: a 500) and is started again; the others go on. `healthy` is False only while a worker
cannot be started again (/health answers 503)."""

import asyncio
import logging
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

from minivllm.serve.tokenizer_worker import serve_jobs

logger = logging.getLogger("minivllm.serve")
START_TIMEOUT = 300.0  # a worker imports transformers and loads the tokenizer


class WorkerDiedError(RuntimeError):
    """The tokenizer worker that held this job died (it is being replaced; the job is lost)."""


@dataclass(slots=True)
class Job:
    name: str
    args: tuple
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class Worker:
    """One worker process and the server thread that feeds it jobs and replaces it when it dies."""

    def __init__(self, pool: "TokenizerPool", index: int) -> None:
        self.pool, self.index = pool, index
        self.process = self.conn = None
        self.ready = threading.Event()  # the first start finished (well or not)
        self.broken = False  # the last start failed
        self.restarts = 0
        self.holding: Job | None = None  # the job its process works on now
        self.thread = threading.Thread(target=self.run, name=f"minivllm-tok-{index}", daemon=True)
        self.thread.start()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        p = self.pool
        self.process = ctx.Process(target=serve_jobs, args=(child_conn, p.model, p.tokenizer, os.getpid()), daemon=True)
        self.process.start()
        child_conn.close()
        self.conn = parent_conn
        if not wait([self.conn, self.process.sentinel], START_TIMEOUT):
            raise RuntimeError(f"it did not load the tokenizer within {START_TIMEOUT:.0f} s")
        try:
            kind, why = self.conn.recv()
        except EOFError:
            self.process.join(1)
            raise RuntimeError(f"it exited while starting (exit code {self.process.exitcode})") from None
        if kind != "ready":
            raise RuntimeError(f"it could not load the tokenizer: {why}")

    def restart(self) -> None:
        self.stop_process()
        try:
            self.start()
            self.broken = False
        except Exception as e:
            self.broken = True
            if not self.pool.closing:  # (shutdown() stops a worker that is still starting: no news)
                logger.error("tokenizer worker %d could not be started: %s", self.index, e)

    def run(self) -> None:
        self.restart()
        self.ready.set()
        while (job := self.pool.jobs.get()) is not None:
            if job.future.cancelled():
                continue
            if not self.broken and not self.process.is_alive():  # it died while idle: the job to another, then
                self.pool.jobs.put(job)  # start a new process (seconds)
                self.replace()
                continue
            if self.broken:  # it could not start: try again, fail the job if it still cannot
                self.replace()
                if self.broken:
                    _settle(job, ("error", WorkerDiedError("no tokenizer worker could be started")))
                    continue
            try:
                _settle(job, self.call(job))
            except Exception as e:  # this thread must outlive any job: else the pool loses a worker for good
                logger.exception("tokenizer worker %d: a %s job failed", self.index, job.name)
                _settle(job, ("error", RuntimeError(f"{type(e).__name__}: {e}")))
            if not self.process.is_alive() and not self.pool.closing:  # it died on that job, whose error is out
                self.replace()
        self.stop_process()

    def replace(self) -> None:
        self.restarts += 0 if self.broken else 1
        self.restart()

    def call(self, job: Job) -> tuple[str, object]:
        try:
            message = pickle.dumps((job.name, job.args))
        except (RecursionError, pickle.PicklingError) as e:  # (a field nested thousands deep)
            return "error", ValueError(f"the request cannot be tokenised: {type(e).__name__}: {e}")
        self.holding = job
        try:
            self.conn.send_bytes(message)
            if self.conn in wait([self.conn, self.process.sentinel]):
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        finally:
            self.holding = None
        self.process.join(1)
        code = self.process.exitcode
        if self.pool.closing:  # shutdown() stopped it
            return "error", WorkerDiedError("the server is shutting down")
        logger.error("tokenizer worker %d died (exit code %s) on a %s job: replacing it", self.index, code, job.name)
        return "error", WorkerDiedError(f"the tokenizer worker died on this request (exit code {code})")

    def stop_process(self, timeout: float = 5.0) -> None:
        if self.process is None:
            return
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()
        self.process = self.conn = None


def _settle(job: Job, result: tuple[str, object]) -> None:
    def settle() -> None:
        if job.future.done():  # cancelled: its client left
            return
        kind, value = result
        job.future.set_result(value) if kind == "ok" else job.future.set_exception(value)

    try:
        job.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # that event loop is closed: nobody listens
        pass


class TokenizerPool:
    def __init__(self, model: str, max_model_len: int, workers: int = 2, tokenizer: str | None = None) -> None:
        """Workers with the tokenizer of checkpoint `model` (or of the directory `tokenizer`), starting now."""
        self.model, self.tokenizer = model, tokenizer or model
        self.max_model_len = max_model_len
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.closing = False
        self.workers = [Worker(self, i) for i in range(workers)]

    @property
    def healthy(self) -> bool:
        """Every worker is up (or being replaced): False only while one cannot be started."""
        return not any(w.broken for w in self.workers)

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.process is not None]

    async def warm_up(self) -> None:
        """Wait until every worker has loaded the tokenizer."""
        await asyncio.to_thread(lambda: [w.ready.wait(START_TIMEOUT) for w in self.workers])

    async def _run(self, name: str, *args):
        loop = asyncio.get_running_loop()
        job = Job(name, args, loop, loop.create_future())
        self.jobs.put(job)
        return await job.future

    async def encode(self, text: str, add_special_tokens: bool = True, limit: bool = True) -> list[int]:
        """The text's ids; with `limit`, a ValueError when they leave no room for output."""
        return await self._run("encode", text, self.limit(limit), add_special_tokens)

    async def chat(self, conversation: list[dict], add_generation_prompt: bool, limit: bool = True, **kwargs):
        """The conversation through the chat template, as ids (`limit` as for encode); a template error is a
        ValueError."""
        return await self._run("chat", conversation, add_generation_prompt, kwargs, self.limit(limit))

    def limit(self, limit: bool) -> int:
        return self.max_model_len if limit else 1 << 62

    async def decode(self, ids: list[int]) -> str:
        return await self._run("decode", ids)

    def shutdown(self, grace: float = 2.0) -> None:
        """Stop the workers: those busy after `grace` seconds (a long template) are killed, their jobs failed."""
        self.closing = True
        for _ in self.workers:
            self.jobs.put(None)
        deadline = time.monotonic() + grace
        for w in self.workers:
            w.thread.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.thread.is_alive() and (process := w.process) is not None and process.pid is not None:
                process.kill()  # (pid None: its thread has made it but not started it yet; it stops after)
            w.thread.join(10)
