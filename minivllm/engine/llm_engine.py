"""The engine (nano-vllm's llm_engine.py) and its step API, vLLM V1's engine core: `add_request(request_id,
prompt_token_ids, params)`, `abort_request(ids)`, `finish_sequences(...)`, `step() -> list[EngineOutput]`,
`has_unfinished_requests()`. It schedules and runs steps and emits token ids: each step, every sequence that
got a token reports it (`EngineOutput`: new token ids, finish reason, raw logprob rows), no text. Its drivers,
`LLM` (llm.py) and the serving engine core (serve/core.py), turn those into RequestOutputs through one output
processor (frontend/output_processor.py). A request arrives tokenized and checked (frontend/processor.py); the
sampling extras reach the engine through the one hook it is given (sampling_hook.py).

One step ahead (the engine's speed on a GPU). `step()` schedules, prepares and launches step N+1 while step
N still runs on the GPU, the sequences' newest tokens being PENDING placeholders on the host that the GPU
feeds in from step N's output (step_inputs.py); only then does it read step N's tokens back and turn them
into outputs. The host work of a step hides behind the GPU work of the previous one. The launch waits for
the step in flight instead when the next step needs its tokens on the host:
- with tensor parallelism: the workers receive each step's token ids from rank 0;
- when a request in flight has penalties, bad words or a grammar: they read every previous token of the
  request, so its newest one must be known (sampling_inputs.py, structured_outputs/). Only such batches lose
  the overlap.

Aborting frees a request's blocks at once (scheduler.py: `finish`), also while a step that computes it is
in flight: that step's token for it is discarded when it arrives. So does `finish_sequences`, with which the
front end ends a sequence whose text reached a stop string.

A request fails alone: one with a grammar waits out of the scheduler while a thread compiles it (the other steps
go on); a step that fails to launch is launched without the requests whose own inputs fail (each ends with
finish_reason "error", the message in stop_reason). Only an error no request alone causes stops the engine."""

import atexit
import time
import weakref
from collections.abc import Callable
from dataclasses import replace

from minivllm.checkpoint import eos_token_ids, load_tokenizer
from minivllm.config import Config
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.request import EngineOutput, EngineRequest
from minivllm.engine.sampling_hook import SamplingHook
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence
from minivllm.engine.step_handle import Launched, StepRecord
from minivllm.engine.tp_workers import Workers
from minivllm.sampling_params import SamplingParams
from minivllm.utils.dist import free_port


class LLMEngine:
    def __init__(self, model: str, sampling_hook: Callable[..., SamplingHook] | None = None, **kwargs) -> None:
        """An engine on `model` (engine arguments in kwargs). `sampling_hook(tokenizer=, vocab_size=, eos=)` makes
        the hook of the sampling extras (frontend/sampling_extras.py); without one the engine samples by
        temperature only."""
        config = Config.from_engine_args(model, **kwargs)
        self.config = config
        port = free_port()
        self.workers = Workers(config, port) if config.tensor_parallel_size > 1 else None
        try:
            self.model_runner = ModelRunner(config, rank=0, port=port, workers=self.workers)
        except BaseException:
            if self.workers is not None:  # a failed start leaves no process behind
                self.workers.exit(timeout=1)
            raise
        self.tokenizer = load_tokenizer(config.tokenizer or model, config.hf_config)
        self.eos = eos_token_ids(model, self.tokenizer)
        self.scheduler = Scheduler(config, self.eos)
        self.vocab_size = config.hf_config.vocab_size
        make_hook, kw = sampling_hook, dict(tokenizer=self.tokenizer, vocab_size=self.vocab_size, eos=self.eos)
        self.sampling_hook: SamplingHook | None = make_hook(**kw) if make_hook is not None else None
        self.requests: dict[str, EngineRequest] = {}  # unfinished, by id
        self.in_flight: Launched | None = None
        self.failed: list[EngineOutput] = []  # outputs of requests that failed alone, for the next step() to return
        self.overlap = config.tensor_parallel_size == 1  # TP workers need each step's tokens on the host
        self.step_log: list[StepRecord] = []
        this = weakref.ref(self)  # at exit, stop the workers of an engine still alive
        self._atexit = lambda: this() is not None and this().exit()
        atexit.register(self._atexit)

    def exit(self) -> None:
        if getattr(self, "model_runner", None) is None:
            return
        atexit.unregister(self._atexit)
        if self.sampling_hook is not None:
            self.sampling_hook.shutdown()  # grammars still compiling are dropped
        if self.workers is not None:
            self.workers.exit()
            self.workers = None
        self.model_runner.exit()
        self.model_runner = None

    # --- requests --------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request that the front end tokenized and checked (frontend/processor.py); it joins the batch at
        the next step. Raises ValueError for an id in use or a grammar that does not compile; a refused request
        leaves nothing behind."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.max_tokens is None:
            params = replace(params, max_tokens=self.config.max_model_len - len(prompt_token_ids))
        request = self.requests[request_id] = EngineRequest.make(request_id, prompt_token_ids, params)
        # sampling hook: a request with a grammar waits out of the scheduler while a thread compiles it
        if self.sampling_hook is None or not self.sampling_hook.add_request(request_id, request.seqs):
            self._schedule(request)

    def _schedule(self, request: EngineRequest) -> None:
        """Hand a request's sequences to the scheduler (those that must wait for the first one's prompt wait)."""
        share = self.config.enable_prefix_caching and request.num_prompt_tokens > self.config.kvcache_block_size
        for seq in request.start(share_prompt=share):
            self.scheduler.add(seq)

    def abort_request(self, request_id: str | list[str]) -> list[EngineOutput]:
        """Abort requests (unknown or finished ids are ignored): their sequences leave the batch and their
        blocks are freed now, wherever they are (waiting, running, or in the step in flight). Returns an
        "abort" output for each sequence it ended."""
        outputs = []
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            request = self.requests.pop(rid, None)
            for seq in request.seqs if request is not None else []:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
                    outputs.append(EngineOutput(rid, seq.index, [], "abort"))
        return outputs

    def finish_sequences(self, targets: list[tuple[str, int]]) -> None:
        """End sequences (request id, index) that the front end saw reach a stop string; their blocks are freed
        now, a token in flight for them is discarded. A request whose sequences have all ended leaves."""
        for rid, index in targets:
            request = self.requests.get(rid)
            if request is None:
                continue
            seq = request.seqs[index]
            if not seq.is_finished:
                self.scheduler.finish(seq, "stop")
            if all(s.is_finished for s in request.seqs):
                del self.requests[rid]

    def has_unfinished_requests(self) -> bool:
        """Requests not finished yet, or a step still in flight (whose tokens step() reads back)."""
        return bool(self.requests) or self.in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def is_finished(self) -> bool:
        return not self.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (only when no request holds blocks); returns whether it did."""
        return self.scheduler.block_manager.reset_prefix_cache()

    # --- the loop --------------------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Launch the next step, then read back the one in flight (the module docstring says why in this
        order). Returns what each sequence got in the step read back."""
        hook = self.sampling_hook
        idle = self.in_flight is None and self.scheduler.is_finished()  # only grammars compiling: wait a little
        for rid, error in hook.ready(wait=0.05 if idle else 0.0) if hook is not None else []:  # sampling hook
            if rid in self.requests:  # (not aborted meanwhile)
                self._fail(rid, f"its grammar failed to compile: {error}") if error else self._schedule(
                    self.requests[rid]
                )
        outputs, progressed = [], False
        if self.in_flight is not None and (not self.overlap or self.in_flight.needs_history):
            in_flight, self.in_flight = self.in_flight, None  # the next launch needs its tokens
            outputs, progressed = self._finish(in_flight), True
        launched = self._launch() if self.requests else None
        if self.in_flight is not None:
            outputs += self._finish(self.in_flight)
            progressed = True
        self.in_flight = launched
        failed, self.failed = self.failed, []
        waiting = hook is not None and hook.num_waiting
        if launched is None and self.requests and not (progressed or failed or waiting):
            raise RuntimeError("scheduler produced an empty step while requests are pending")
        return outputs + failed

    def _launch(self) -> Launched | None:
        """Schedule one step and launch it without waiting. None when nothing can be scheduled now."""
        t0 = time.perf_counter()
        seqs = self.scheduler.schedule()
        if not seqs:
            return None
        is_prefill = any(s.num_scheduled_tokens != 1 or s.num_computed_tokens != s.num_tokens - 1 for s in seqs)
        record = StepRecord(is_prefill, len(seqs), sum(s.num_scheduled_tokens for s in seqs), 0.0, 0.0, 0.0)
        t1 = time.perf_counter()
        try:
            handle = self.model_runner.launch(seqs, is_prefill, self.sampling_hook)
        except Exception as e:
            seqs = self._without_culprits(seqs, is_prefill, e)  # re-raises when no request alone is at fault
            if not seqs:
                return None
            handle = self.model_runner.launch(seqs, is_prefill, self.sampling_hook)
        sampled = self.scheduler.on_launch(seqs)
        record.schedule, record.run = t1 - t0, time.perf_counter() - t1
        needs_history = any(s.sampling_params.needs_history or s.sampling_params.structured_outputs for s in seqs)
        return Launched(seqs, sampled, handle, record, needs_history)

    def _without_culprits(self, seqs: list[Sequence], is_prefill: bool, error: Exception) -> list[Sequence]:
        """A step failed to launch: fail the requests whose own inputs fail, return the sequences left (or re-raise)."""
        r, hook = self.model_runner, self.sampling_hook  # sampling hook: each request's step prepared alone
        prepare = r.prepare_prefill if is_prefill else r.prepare_decode
        culprits = hook.failing_requests(seqs, prepare, r.buffers, r.device) if hook is not None else {}
        if not culprits or self.workers is not None:  # (TP workers may have started the step: none can be left out)
            raise error
        for rid, e in culprits.items():
            self._fail(rid, f"preparing its step failed: {type(e).__name__}: {e}")
        return [s for s in seqs if not s.is_finished]

    def _fail(self, request_id: str, message: str) -> None:
        """End a request on its own error: sequences finish with "error" (the message their stop_reason), blocks
        freed, their outputs in the next step()'s."""
        request = self.requests.pop(request_id)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
                self.failed.append(EngineOutput(request_id, seq.index, [], "error", message))
        request.deferred = []

    def _finish(self, launched: Launched) -> list[EngineOutput]:
        """Wait for a launched step's tokens, account them (scheduler.postprocess's two halves), and report
        what each sequence got."""
        t = time.perf_counter()  # postprocess includes the wait for the GPU (StepRecord: where the wall time went)
        tokens, logprobs = launched.handle.result()
        if launched.handle.prompt_logprobs is not None:  # sampling hook: prompt logprobs, a chunk at a time
            for row, first, entries in self.sampling_hook.prompt_logprobs_rows(*launched.handle.prompt_logprobs):
                seq = launched.seqs[row]
                if not seq.is_finished:
                    self.requests[seq.request_id].add_prompt_rows(first, entries)
        live = [(seq, pos) for seq, pos in launched.sampled if not seq.is_finished]  # an aborted one's is dropped
        self.scheduler.on_result(launched.seqs, launched.sampled, tokens)
        if self.sampling_hook is not None:  # sampling hook: grammars take the tokens (one may end its sequence)
            self.sampling_hook.advance(live, self.scheduler.finish)
        row_of = {id(s): i for i, s in enumerate(launched.seqs)}
        outputs = []
        for seq, pos in live:
            request = self.requests[seq.request_id]
            for other in reversed(request.release(seq, pos)):  # they arrived with it: the front of the queue
                self.scheduler.add(other, front=True)
            out = EngineOutput(seq.request_id, seq.index, [seq.token_ids[pos]], seq.finish_reason, seq.stop_reason)
            if seq.sampling_params.logprobs is not None:
                out.new_logprobs = [logprobs[row_of[id(seq)]]]
            if request.prompt_rows is not None and not request.prompt_rows_sent and seq.index == 0:
                out.prompt_logprobs, request.prompt_rows_sent = request.prompt_rows, True
            outputs.append(out)
        for rid in {out.request_id for out in outputs if out.finish_reason is not None}:
            if all(s.is_finished for s in self.requests[rid].seqs):
                del self.requests[rid]
        launched.record.postprocess = time.perf_counter() - t
        self.step_log.append(launched.record)
        return outputs
