"""The API server's client of the engine-core process (vLLM V1's AsyncMPClient + AsyncLLM front end), with
AsyncLLM's interface: `async for output in client.generate(prompt, params, request_id)`, abort(), shutdown().

    API server process                                    engine-core process (core.py)
    event loop: HTTP, SSE   output thread                 LLMEngine stepping
    generate() --- AddRequest over ZMQ (PUSH) ----------> scheduler + model
    its collector  <------- RequestOutputs <-- decode --- StepOutputs, one per step (PUSH): EngineOutputs
                            the output processor
                            (detokenise, stop strings, n)

The output thread blocks in ZMQ (releasing the GIL) until the core's next message or death (its process
sentinel is polled beside the socket): a dead core ends every open stream with EngineDeadError at once and
`is_running` turns False (/health: 503). A step's outputs reach an event loop in one call_soon_threadsafe.
One lock guards the output processor, the streams and the sending socket, shared by the event loops that call
generate() and the output thread (which tells the core to end sequences that hit a stop string). shutdown()
asks the core to stop (it aborts what runs, stops its TP workers, exits), then waits for it; one of several API
servers (api_servers.py) shares the core: it aborts its own requests and leaves, the parent stops the core."""

import asyncio
import atexit
import itertools
import os
import threading
import weakref
from collections.abc import AsyncIterator

import zmq
from transformers import AutoConfig

from minivllm.checkpoint import load_tokenizer
from minivllm.frontend.output_processor import OutputProcessor
from minivllm.frontend.outputs import RequestOutput
from minivllm.frontend.processor import Processor
from minivllm.frontend.requests import Request
from minivllm.sampling_params import SamplingParams
from minivllm.serve import messages as m
from minivllm.serve.core_process import AttachedCore, CoreProcess
from minivllm.serve.messages import EngineDeadError
from minivllm.serve.output_collector import RequestOutputCollector, check_stream_interval


class AsyncMPClient:
    def __init__(self, model: str, core: AttachedCore | None = None, stream_interval: int = 1, **engine_args) -> None:
        """Start an engine core on `model` in a new process, or talk to the one `core` reaches (one of several API
        servers, api_servers.py), and wait until it is ready (its error, if not). `stream_interval`: a stream's
        tokens per wake-up after its first (output_collector.py)."""
        check_stream_interval(stream_interval)
        self.stream_interval = stream_interval
        self.engine_args = dict(engine_args)
        self.core = core if core is not None else CoreProcess(model, self.engine_args)
        self.wake_r, self.wake_w = os.pipe()  # shutdown() wakes the output thread (the core may not end)
        self.lock = threading.Lock()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestOutputCollector]] = {}  # by request id
        self.calls: dict[int, tuple] = {}  # utility call id -> (loop, future)
        self.call_ids = itertools.count()
        self.stats = m.SchedulerStats(0, 0, 0.0, 0)  # the core's gauges after its last step
        self.error: BaseException | None = None  # why the core stopped
        self.closed, self.stopping = False, False  # the core is gone; shutdown() asked it to stop
        try:
            self.info = self.core.wait_ready()
            self.tokenizer = load_tokenizer(self.info.tokenizer, AutoConfig.from_pretrained(model))
        except BaseException:
            self.core.stop(timeout=10)
            self.core.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            raise
        self.model, self.max_model_len = self.info.model, self.info.max_model_len
        self.tokenizer_dir = self.info.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)  # in the output thread, under the lock
        i = self.info  # the core's limits: requests are checked here, as the offline engine checks them
        self.processor = Processor(
            self.tokenizer, i.vocab_size, i.max_model_len, i.kvcache_block_size, i.num_kvcache_blocks,
            i.tensor_parallel_size,
        )  # fmt: skip
        self.thread = threading.Thread(target=self._run, name="minivllm-outputs", daemon=True)
        self.thread.start()
        this = weakref.ref(self)  # at exit, stop the core of a client still alive
        self._atexit = lambda: this() is not None and this().shutdown()
        atexit.register(self._atexit)

    # --- the asyncio side ---------------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return not self.closed

    def generate(self, prompt, sampling_params: SamplingParams | None, request_id: str) -> AsyncIterator[RequestOutput]:
        """AsyncLLM.generate's contract: a bad request raises ValueError / TypeError here, before anything is
        queued; closing the iteration aborts the request. Text prompts are tokenised here: the server passes
        token ids it tokenised off the event loop."""
        if self.closed:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        request = self.processor.process(request_id, prompt, sampling_params)
        queue = RequestOutputCollector(request.params.output_kind, self.stream_interval)  # merges DELTA outputs
        rid = request.request_id  # (the collector's own generator: no layer in between on every token)
        return queue.outputs(abort=lambda: self.abort(rid), start=lambda: self._add(request, queue))

    def _add(self, request: Request, queue: RequestOutputCollector) -> None:
        """Queue the request in the core (at its stream's first iteration, on the event loop)."""
        rid = request.request_id
        try:
            add = m.AddRequest.make(rid, request.prompt_token_ids, request.params)
        except RecursionError:  # e.g. a JSON schema nested hundreds deep: pickle cannot carry it
            raise ValueError("structured_outputs: nested too deeply to send to the engine") from None
        with self.lock:
            if self.closed:
                raise EngineDeadError(f"the engine is not running: {self.error!r}")
            self.output_processor.add_request(request)  # (ValueError: the id is in use)
            self.streams[rid] = (asyncio.get_running_loop(), queue)
            self.core.send(add)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (thread-safe; unknown ids are ignored); the core frees their blocks."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self.lock:
            ids = [rid for rid in ids if self.streams.pop(rid, None) is not None]
            self.output_processor.abort_requests(ids)
            if ids and not self.closed:
                self.core.send(m.Abort(ids))

    def abort_all(self) -> None:
        """Every request ends now with finish_reason "abort" (the core answers with their final outputs). Safe
        in a signal handler: the interrupted thread may hold the lock, so a helper thread takes it."""
        threading.Thread(target=self._abort_all, name="minivllm-abort-all", daemon=True).start()

    def _abort_all(self) -> None:
        with self.lock:
            if not self.closed:
                self.core.send(m.AbortAll())

    async def reset_prefix_cache(self) -> bool:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.lock:
            if self.closed:
                raise EngineDeadError(f"the engine is not running: {self.error!r}")
            call_id = next(self.call_ids)
            self.calls[call_id] = (loop, future)
            self.core.send(m.Utility(call_id, "reset_prefix_cache"))
        return await future

    def shutdown(self, timeout: float = 60) -> None:
        """Abort every request, stop the core (and its TP workers), and wait for it."""
        atexit.unregister(self._atexit)
        if self.stopping:  # shut down already
            return
        self.stopping = True
        with self.lock:  # (the core's last outputs, each stream's "abort", still reach their streams)
            self.core.send(m.Shutdown() if self.core.owned else m.AbortAll())  # (a shared core: this one's only)
        self.core.stop(timeout)
        if not self.core.owned:  # the core goes on (the parent stops it): wake the output thread
            os.write(self.wake_w, b"x")
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        self._close(EngineDeadError("the engine was shut down"))
        self.core.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    # --- the output thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.core.output, zmq.POLLIN)
        poller.register(self.core.sentinel, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self.core.output in events:
                while True:  # the core's messages in order; the sentinel only after they are read
                    try:
                        msg = self.core.dec.decode(self.core.output.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    self._process(msg)
            elif events:  # the core's process ended (its last messages read), or shutdown() woke this thread
                why = "was shut down" if self.stopping else self.core.exit_reason()
                self._close(EngineDeadError(f"the engine {why}"))
                return

    def _process(self, msg: m.StepOutputs) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self.lock:
            self.stats = msg.stats
            for rid, why in msg.refused:  # the core did not queue it: its stream fails
                target = self.streams.pop(rid, None)
                self.output_processor.abort_requests([rid])
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], ValueError(why)))
            outputs, stopped = self.output_processor.process(msg.outputs)
            for output in outputs:
                target = self.streams.get(output.request_id)
                if target is None:
                    continue
                if output.finished:
                    del self.streams[output.request_id]
                    output = m.failure_of(output)
                by_loop.setdefault(target[0], []).append((target[1], output))
            if stopped:
                self.core.send(m.FinishSequences(stopped))
            if msg.utility is not None:
                loop, future = self.calls.pop(msg.utility[0])
                by_loop.setdefault(loop, []).append((future, msg.utility[1]))
        for loop, items in by_loop.items():
            _send(loop, _put_all, items)

    def _close(self, error: EngineDeadError) -> None:
        """The core is gone: every open stream and call ends with `error`."""
        with self.lock:
            if self.closed:
                return
            self.closed, self.error = True, error
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for loop, queue in self.streams.values():
                by_loop.setdefault(loop, []).append((queue, error))
            for loop, future in self.calls.values():
                by_loop.setdefault(loop, []).append((future, error))
            self.output_processor.abort_requests(list(self.streams))
            self.streams.clear()
            self.calls.clear()
        for loop, items in by_loop.items():
            _send(loop, _put_all, items)


def _send(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody listens
        pass


def _put_all(items: list) -> None:
    for target, item in items:
        if isinstance(target, RequestOutputCollector):
            target.put_nowait(item)
        elif not target.done():
            target.set_exception(item) if isinstance(item, BaseException) else target.set_result(item)
