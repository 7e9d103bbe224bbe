"""The engine (nano-vllm's llm_engine.py) and its step API, vLLM's: `add_request(request_id, prompt, params)`,
`abort_request(ids)`, `step() -> list[RequestOutput]`, `has_unfinished_requests()`. `LLM.generate` (llm.py)
and the server's loop (async_llm.py) both drive it through these four calls. A request is tokenized and
checked (processor.py) before it is queued, so a bad one is refused with a clear error and never enters the
scheduler; what it reports at each of its tokens is its own business (requests.py).

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
in flight: that step's token for it is discarded when it arrives.

A request fails alone: one with a grammar waits out of the scheduler while a thread compiles it (the other steps
go on); a step that fails to launch is launched without the requests whose own inputs fail (each ends with
finish_reason "error", the message in stop_reason). Only an error no request alone causes stops the engine."""

import atexit
import time
import weakref
from dataclasses import dataclass

from minivllm.checkpoint import load_tokenizer
from minivllm.config import Config
from minivllm.engine.model_runner import ModelRunner, StepHandle
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence
from minivllm.engine.tp_workers import Workers
from minivllm.frontend import prompt_logprobs
from minivllm.frontend.outputs import RequestOutput
from minivllm.frontend.processor import Processor, eos_token_ids
from minivllm.frontend.requests import FINAL_ONLY, Request
from minivllm.frontend.sampling_inputs import failing_requests
from minivllm.frontend.structured_outputs.manager import StructuredOutputs
from minivllm.sampling_params import SamplingParams
from minivllm.utils.dist import free_port


@dataclass(slots=True)
class StepRecord:
    """Where one step's wall time went (host seconds; `run` includes the GPU work, which it waits for)."""

    is_prefill: bool
    num_seqs: int
    num_tokens: int
    schedule: float
    run: float
    postprocess: float


@dataclass(slots=True)
class Launched:
    """A step launched on the device whose tokens have not been read back yet."""

    seqs: list[Sequence]
    sampled: list[tuple[Sequence, int]]  # (sequence, position of its PENDING token)
    handle: StepHandle
    record: StepRecord
    needs_history: bool  # a request in it has penalties, bad words or a grammar: finish it before the next launch


class LLMEngine:
    def __init__(self, model: str, **kwargs) -> None:
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
        self.model_runner.eos = self.eos
        self.scheduler = Scheduler(config, self.eos)
        self.structured_outputs = StructuredOutputs(self.tokenizer, config.hf_config.vocab_size, self.eos)
        self.vocab_size = config.hf_config.vocab_size
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.in_flight: Launched | None = None
        self.failed: list[RequestOutput] = []  # outputs of requests that failed, for the next step() to return
        self.overlap = config.tensor_parallel_size == 1  # TP workers need each step's tokens on the host
        self.step_log: list[StepRecord] = []
        this = weakref.ref(self)  # at exit, stop the workers of an engine still alive
        self._atexit = lambda: this() is not None and this().exit()
        atexit.register(self._atexit)

    def exit(self) -> None:
        if getattr(self, "model_runner", None) is None:
            return
        atexit.unregister(self._atexit)
        self.structured_outputs.shutdown()  # grammars still compiling are dropped
        if self.workers is not None:
            self.workers.exit()
            self.workers = None
        self.model_runner.exit()
        self.model_runner = None

    # --- requests --------------------------------------------------------------------------------------

    @property
    def processor(self) -> Processor:
        """Tokenizes and checks requests against this engine's limits (processor.py)."""
        return Processor.of(self.config, self.tokenizer)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request (vLLM's signature): `prompt` in any form of minivllm/frontend/inputs.py, or a Request that a
        Processor made already (in another thread, with its own tokenizer). It joins the batch at the next step.
        Raises ValueError / TypeError naming the problem; a refused request leaves nothing behind."""
        request = prompt if isinstance(prompt, Request) else self.processor.process(request_id, prompt, params)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if not self.structured_outputs.submit(request):  # a grammar compiles off the step loop; the request waits
            self._schedule(request)

    def _schedule(self, request: Request) -> None:
        """Hand a request's sequences to the scheduler (those that must wait for the first one's prompt wait)."""
        share = self.config.enable_prefix_caching and len(request.prompt_token_ids) > self.config.kvcache_block_size
        for seq in request.start(self.tokenizer, share_prompt=share and request.params.prompt_logprobs is None):
            self.scheduler.add(seq)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored): their sequences leave the batch and their
        blocks are freed now, wherever they are (waiting, running, or in the step in flight)."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            request = self.requests.pop(rid, None)
            for seq in request.seqs if request is not None else []:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")

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

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then read back the one in flight (the module docstring says why in this
        order). Returns the outputs of the requests that got new tokens (per their output_kind)."""
        idle = self.in_flight is None and self.scheduler.is_finished()  # only grammars compiling: wait a little
        for request, error in self.structured_outputs.ready(wait=0.05 if idle else 0.0):
            if request.request_id in self.requests:  # (not aborted meanwhile)
                self._fail(request, f"its grammar failed to compile: {error}") if error else self._schedule(request)
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
        if launched is None and self.requests and not (progressed or failed or self.structured_outputs.pending):
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
            handle = self.model_runner.launch(seqs, is_prefill)
        except Exception as e:
            seqs = self._without_culprits(seqs, is_prefill, e)  # re-raises when no request alone is at fault
            if not seqs:
                return None
            handle = self.model_runner.launch(seqs, is_prefill)
        sampled = self.scheduler.on_launch(seqs)
        record.schedule, record.run = t1 - t0, time.perf_counter() - t1
        needs_history = any(s.sampling_params.needs_history or s.sampling_params.structured_outputs for s in seqs)
        return Launched(seqs, sampled, handle, record, needs_history)

    def _without_culprits(self, seqs: list[Sequence], is_prefill: bool, error: Exception) -> list[Sequence]:
        """A step failed to launch: fail the requests whose own inputs fail, return the sequences left (or re-raise)."""
        r, kw = self.model_runner, dict(device=self.model_runner.device, eos=self.eos, vocab=self.vocab_size)
        culprits = failing_requests(seqs, r.prepare_prefill if is_prefill else r.prepare_decode, r.buffers, **kw)
        if not culprits or self.workers is not None:  # (TP workers may have started the step: none can be left out)
            raise error
        for rid, e in culprits.items():
            self._fail(self.requests[rid], f"preparing its step failed: {type(e).__name__}: {e}")
        return [s for s in seqs if not s.is_finished]

    def _fail(self, request: Request, message: str) -> None:
        """End a request on its own error: sequences finish with "error", blocks freed, its output in step()'s."""
        del self.requests[request.request_id]
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
                seq.stop_reason = message
        request.deferred = []
        self.failed.append(request.output(request.seqs, self.tokenizer))

    def _finish(self, launched: Launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens, account them, and make the outputs (requests.py)."""
        t = time.perf_counter()  # postprocess includes the wait for the GPU (StepRecord: where the wall time went)
        tokens, logprobs = launched.handle.result()
        rows = {id(s): i for i, s in enumerate(launched.seqs)}
        if launched.handle.prompt_logprobs is not None:
            for row, first, entries in prompt_logprobs.split(*launched.handle.prompt_logprobs):
                seq = launched.seqs[row]
                if not seq.is_finished:
                    self.requests[seq.request_id].add_prompt_logprobs(first, entries, self.tokenizer)
        # sequences with per-token work (an aborted one's token is dropped); the others need nothing until done
        work = [(seq, pos) for seq, pos in launched.sampled if seq.output_work and not seq.is_finished]
        finished = self.scheduler.on_result(launched.seqs, launched.sampled, tokens)
        finished += self.structured_outputs.advance(launched.sampled, self.scheduler)  # grammars take the tokens
        changed: dict[str, list[Sequence]] = {}
        for seq, pos in work:
            request = self.requests[seq.request_id]
            if request.on_token(seq, pos, logprobs.get(rows[id(seq)]), self.tokenizer) and not seq.is_finished:
                self.scheduler.finish(seq, "stop")  # a stop string
                finished.append(seq)
            for other in reversed(request.release(seq, pos)):  # they arrived with it: the front of the queue
                self.scheduler.add(other, front=True)
            if not seq.is_finished and seq.sampling_params.output_kind != FINAL_ONLY:
                changed.setdefault(seq.request_id, []).append(seq)
        for seq in finished:
            changed.setdefault(seq.request_id, []).append(seq)
        outputs = [o for rid, seqs in changed.items() if (o := self.requests[rid].output(seqs, self.tokenizer))]
        for output in outputs:
            if output.finished:
                del self.requests[output.request_id]
        launched.record.postprocess = time.perf_counter() - t
        self.step_log.append(launched.record)
        return outputs
