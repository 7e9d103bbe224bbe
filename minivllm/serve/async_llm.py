"""The async engine (vLLM's AsyncLLM): the engine's step loop in one background thread, and an asyncio API
beside it, `async for output in llm.generate(prompt, params, request_id)`, that the server and notebook 16
use. Requests that arrive while others run join the batch at the next step (continuous batching across
clients), and each request's tokens stream out as they are sampled.

    event loop thread (the server)                engine thread (one per AsyncLLM)
    ------------------------------                --------------------------------
    generate(): tokenize + validate (its own      while running:
      tokenizer), commands.put(add) --------->      apply commands: add / abort     (between steps only)
      await its output collector                    outputs = llm.step()             (the GPU works here;
      yield each output  <-- call_soon_threadsafe -- deliver the outputs, one call   the output processor
                                                      per step                        makes RequestOutputs)
    abort() / closing the generator: put(abort)    no request: block on the command queue

The scheduler is touched by the engine thread only: other threads reach it through the command queue, so
no lock is needed and the event loop never waits on a GPU step. An abort takes effect at the next gap
between steps (the engine frees the request's blocks at once, also when a step in flight computes it).
`shutdown()` aborts what is left (each stream ends with finish_reason "abort"), stops the thread, then
the engine and its tensor-parallel workers.

`AsyncLLM(model, multiprocess=True, ...)` gives the same interface with the engine in a process of its own
(core_client.py), where its steps do not share this process's GIL: what `minivllm serve` runs."""

import asyncio
import copy
import queue
import threading
from collections.abc import AsyncIterator
from contextlib import aclosing

import torch

from minivllm.frontend.outputs import RequestOutput
from minivllm.frontend.processor import Processor
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.serve.core_client import AsyncMPClient
from minivllm.serve.messages import EngineDeadError, SchedulerStats, failure_of
from minivllm.serve.output_collector import RequestOutputCollector, check_stream_interval

__all__ = ["AsyncLLM", "EngineDeadError"]


class AsyncLLM:
    def __new__(cls, model: str | LLM, multiprocess: bool = False, stream_interval: int = 1, **engine_args):
        if multiprocess:  # the engine core in its own process, this interface in front of it
            return AsyncMPClient(model, stream_interval=stream_interval, **engine_args)
        return super().__new__(cls)

    def __init__(self, model: str | LLM, multiprocess: bool = False, stream_interval: int = 1, **engine_args) -> None:
        """An engine on `model` (a checkpoint directory, with engine arguments), or around an LLM made already;
        either way the AsyncLLM owns it from now on (shutdown() stops it). `stream_interval`: a stream's tokens
        per wake-up after its first (output_collector.py)."""
        check_stream_interval(stream_interval)
        self.stream_interval = stream_interval
        self.engine = model if isinstance(model, LLM) else LLM(model, **engine_args)
        self.model, self.max_model_len = self.engine.config.model, self.engine.config.max_model_len
        self.tokenizer_dir = self.engine.config.tokenizer or self.model
        self.tokenizer = copy.deepcopy(self.engine.tokenizer)  # the event loop's own: never shared across threads
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestOutputCollector]] = {}  # engine thread only
        self.error: BaseException | None = None  # what stopped the engine thread, if it failed
        self.closed = False  # the engine thread has stopped (failed or shut down)
        self.thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self.thread.start()

    # --- the asyncio side ---------------------------------------------------------------------------------

    def generate(self, prompt, sampling_params: SamplingParams | None, request_id: str) -> AsyncIterator[RequestOutput]:
        """`async for output in llm.generate(...)`: the request's outputs as its tokens are sampled (per the
        params' output_kind; the last one has finished=True). A bad request raises ValueError / TypeError here,
        before anything is queued; the request is queued when iteration starts. Closing or cancelling the
        iteration aborts the request."""
        if self.closed:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        return self._stream(
            Processor.of(self.engine.config, self.tokenizer).process(request_id, prompt, sampling_params)
        )

    async def _stream(self, request) -> AsyncIterator[RequestOutput]:
        request_id = request.request_id
        stream = RequestOutputCollector(request.params.output_kind, self.stream_interval)  # merges DELTA outputs
        self.commands.put(("add", request, asyncio.get_running_loop(), stream))
        if self.closed:  # it stopped meanwhile: nobody will read the command
            self._drain(EngineDeadError(f"the engine is not running: {self.error!r}"))
        async with aclosing(stream.outputs(abort=lambda: self.abort(request_id))) as outputs:  # aborts at once
            async for output in outputs:
                yield output

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (thread-safe; unknown ids are ignored): each open stream ends with a final output
        whose finish_reason is "abort"."""
        self.commands.put(("abort", request_id))

    async def reset_prefix_cache(self) -> bool:
        """The engine's reset_prefix_cache, run in the engine thread between steps (benchmarks start cold)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.commands.put(("call", self.engine.reset_prefix_cache, loop, future))
        if self.closed:
            self._drain(EngineDeadError(f"the engine is not running: {self.error!r}"))
        return await future

    def abort_all(self) -> None:
        """Abort every request (thread-safe, and safe in a signal handler: SimpleQueue.put is reentrant)."""
        self.commands.put(("abort_all",))

    def shutdown(self, timeout: float = 60) -> None:
        """Abort every request, stop the engine thread, then the engine (and its TP workers)."""
        if self.thread.is_alive():
            self.commands.put(("stop",))
            self.thread.join(timeout)
        self.engine.exit()

    @property
    def is_running(self) -> bool:
        return not self.closed

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's gauges (read from another thread: a moment's snapshot)."""
        s = self.engine.scheduler
        free, total = s.block_manager.num_free_blocks, max(1, len(s.block_manager.blocks))
        hook = self.engine.sampling_hook
        waiting = len(s.waiting) + (hook.num_waiting if hook is not None else 0)  # (grammars compiling: waiting too)
        return SchedulerStats(len(s.running) + len(s.finishing), waiting, 1 - free / total, s.num_preemptions)

    # --- the engine thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        error = EngineDeadError("the engine was shut down")
        try:
            if self.engine.config.device == "cuda":
                torch.cuda.set_device(self.engine.model_runner.device)  # the current device is per thread
            while self._apply_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
        except BaseException as e:  # a dead engine must not leave a client waiting forever
            self.error, error = e, EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}")
            raise
        finally:
            self.closed = True
            for loop, stream in self.streams.values():
                _send(loop, stream.put_nowait, error)
            self.streams.clear()
            self._drain(error)

    def _apply_commands(self, block: bool) -> bool:
        """Apply the queued commands (waiting for one if `block`). False once asked to stop."""
        try:
            command = self.commands.get() if block else self.commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command[0] == "add":
                _, request, loop, stream = command
                try:
                    self.engine.add_request(request.request_id, request)
                except (ValueError, TypeError) as e:  # e.g. a request id already in use
                    _send(loop, stream.put_nowait, e)
                except BaseException as e:  # the engine failed: the thread stops, and this stream hears why
                    _send(loop, stream.put_nowait, EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}"))
                    raise
                else:
                    self.streams[request.request_id] = (loop, stream)
            elif command[0] == "abort":
                self._abort([command[1]] if isinstance(command[1], str) else list(command[1]))
            elif command[0] == "abort_all":
                self._abort(list(self.engine.requests))
            elif command[0] == "call":  # a function that must run in this thread, its result to a future
                _, fn, loop, future = command
                try:
                    _send(loop, future.set_result, fn())
                except Exception as e:
                    _send(loop, future.set_exception, e)
            else:  # stop
                self._abort(list(self.engine.requests))
                return False
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _abort(self, ids: list[str]) -> None:
        self._deliver(self.engine.abort_request(ids))  # each open stream's final output, finish_reason "abort"

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand the outputs to their streams' event loops: one call per loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            target = self.streams.get(output.request_id)
            if target is None:
                continue
            if output.finished:
                del self.streams[output.request_id]
                output = failure_of(output)
            by_loop.setdefault(target[0], []).append((target[1], output))
        for loop, items in by_loop.items():
            _send(loop, _put_all, items)

    def _drain(self, error: BaseException) -> None:
        """After the engine thread stopped: fail the requests still in the command queue."""
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _send(command[2], command[3].put_nowait, error)
            elif command[0] == "call":
                _send(command[2], command[3].set_exception, error)


def _send(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody listens
        pass


def _put_all(items: list[tuple[RequestOutputCollector, RequestOutput]]) -> None:
    for stream, output in items:
        stream.put_nowait(output)
