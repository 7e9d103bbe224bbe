"""The engine (nano-vllm's llm_engine.py) and its step API, vLLM's: `add_request(request_id, prompt, params)`,
`abort_request(ids)`, `step() -> list[RequestOutput]`, `has_unfinished_requests()`. `LLM.generate` (llm.py)
and the server's loop (async_llm.py) both drive it through these four calls. Requests are validated before
they are queued, so a bad one is refused with a clear error and never enters the scheduler.

One step ahead (the engine's speed on a GPU). `step()` schedules, prepares and launches step N+1 while step
N still runs on the GPU, the sequences' newest tokens being PENDING placeholders on the host that the GPU
feeds in from step N's output (step_inputs.py); only then does it read step N's tokens back and turn them
into outputs. The host work of a step hides behind the GPU work of the previous one. The launch waits for
the step in flight instead when the next step needs its tokens on the host:
- with tensor parallelism: the workers receive each step's token ids from rank 0;
- when a request in flight has penalties or a grammar: they read every previous token of the request, so its
  newest one must be known (sampling_inputs.py, structured_outputs/). Only such batches lose the overlap.

A request of `n` completions has `n` sequences. With prefix caching, sequences 1..n-1 wait until sequence 0
has computed the prompt and then find its blocks in the prefix cache, so the prompt is computed once.

Aborting frees a request's blocks at once (scheduler.py: `finish`), also while a step that computes it is
in flight: that step's token for it is discarded when it arrives."""

import atexit
import time
import weakref
from dataclasses import dataclass, replace

from minivllm.config import Config, load_tokenizer
from minivllm.engine.detokenizer import Detokenizer
from minivllm.engine.model_runner import ModelRunner, StepHandle
from minivllm.engine.requests import FINAL_ONLY, Request, add_logprobs, check_request, eos_token_ids, request_output
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence
from minivllm.engine.tp_workers import Workers
from minivllm.inputs import parse_prompt
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.structured_outputs.manager import StructuredOutputs
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
    needs_history: bool  # a request in it has penalties: finish it before the next launch


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
        self.tokenizer = load_tokenizer(model, config.hf_config)
        self.eos = eos_token_ids(model, self.tokenizer)
        self.model_runner.eos = self.eos
        self.scheduler = Scheduler(config, self.eos)
        self.structured_outputs = StructuredOutputs(self.tokenizer, config.hf_config.vocab_size, self.eos)
        self.vocab_size = config.hf_config.vocab_size
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.in_flight: Launched | None = None
        self.overlap = config.tensor_parallel_size == 1  # TP workers need each step's tokens on the host
        self.step_log: list[StepRecord] = []
        this = weakref.ref(self)  # at exit, stop the workers of an engine still alive
        self._atexit = lambda: this() is not None and this().exit()
        atexit.register(self._atexit)

    def exit(self) -> None:
        if getattr(self, "model_runner", None) is None:
            return
        atexit.unregister(self._atexit)
        if self.workers is not None:
            self.workers.exit()
            self.workers = None
        self.model_runner.exit()
        self.model_runner = None

    # --- requests --------------------------------------------------------------------------------------

    def check_request(self, token_ids: list[int], sp: SamplingParams) -> None:
        check_request(self.config, self.vocab_size, token_ids, sp)

    def make_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None = None,
        *,
        output_kind: RequestOutputKind | None = None,
        tokenizer=None,
    ) -> Request:
        """Tokenize and validate a request without queueing it (thread-safe: reads no scheduler state; pass
        another `tokenizer` from another thread). Raises ValueError / TypeError naming the problem."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        params = params if params is not None else SamplingParams()
        text, token_ids = parse_prompt(prompt)
        if token_ids is None:
            token_ids = (tokenizer or self.tokenizer).encode(text)
        self.check_request(token_ids, params)
        changes = dict(output_kind=output_kind if output_kind is not None else params.output_kind)
        if params.max_tokens is None:
            changes["max_tokens"] = self.config.max_model_len - len(token_ids)
        params = replace(params, **changes)  # the engine's own copy
        seqs = []
        for i in range(params.n):  # child i draws from seed + i, as vLLM
            child = replace(params, n=1, seed=params.seed + i) if params.n > 1 and params.seed is not None else params
            seqs.append(Sequence(token_ids, child, request_id, i))
        self.structured_outputs.attach(seqs)  # a matcher per sequence (ValueError: an invalid grammar)
        return Request(request_id, text, token_ids, params, seqs, [])

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request (vLLM's signature; `prompt` in any form of minivllm/inputs.py). It joins the batch
        at the next step."""
        self.queue_request(self.make_request(request_id, prompt, params))

    def queue_request(self, request: Request) -> None:
        """Queue a request made by make_request."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        share = self.config.enable_prefix_caching and len(request.prompt_token_ids) > self.config.kvcache_block_size
        first, rest = request.seqs[0], request.seqs[1:]
        for seq in request.seqs:
            sp = seq.sampling_params
            if sp.stop or sp.output_kind != FINAL_ONLY:
                seq.detokenizer = Detokenizer(self.tokenizer, sp)
            if sp.logprobs is not None:
                seq.logprobs = []
            seq.output_work = seq.detokenizer is not None or seq.logprobs is not None
        self.scheduler.add(first)
        if share and rest:
            request.deferred = rest
            first.output_work = True  # its first token releases them
        else:
            for seq in rest:
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
        outputs, progressed = [], False
        if self.in_flight is not None and (not self.overlap or self.in_flight.needs_history):
            in_flight, self.in_flight = self.in_flight, None  # the next launch needs its tokens
            outputs, progressed = self._finish(in_flight), True
        launched = self._launch() if self.requests else None
        if self.in_flight is not None:
            outputs += self._finish(self.in_flight)
            progressed = True
        self.in_flight = launched
        if launched is None and not progressed and self.requests:
            raise RuntimeError("scheduler produced an empty step while requests are pending")
        return outputs

    def _launch(self) -> Launched | None:
        """Schedule one step and launch it without waiting. None when nothing can be scheduled now."""
        t0 = time.perf_counter()
        seqs = self.scheduler.schedule()
        if not seqs:
            return None
        is_prefill = any(s.num_scheduled_tokens != 1 or s.num_computed_tokens != s.num_tokens - 1 for s in seqs)
        record = StepRecord(is_prefill, len(seqs), sum(s.num_scheduled_tokens for s in seqs), 0.0, 0.0, 0.0)
        t1 = time.perf_counter()
        handle = self.model_runner.launch(seqs, is_prefill)
        sampled = self.scheduler.on_launch(seqs)
        record.schedule, record.run = t1 - t0, time.perf_counter() - t1
        needs_history = any(s.sampling_params.needs_history or s.sampling_params.structured_outputs for s in seqs)
        return Launched(seqs, sampled, handle, record, needs_history)

    def _finish(self, launched: Launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens, account them, and make the outputs."""
        t = time.perf_counter()  # postprocess includes the wait for the GPU (StepRecord: where the wall time went)
        tokens, logprobs = launched.handle.result()
        # sequences with per-token work (an aborted one's token is dropped); the others need nothing until done
        work = [(seq, pos) for seq, pos in launched.sampled if seq.output_work and not seq.is_finished]
        finished = self.scheduler.on_result(launched.seqs, launched.sampled, tokens)
        finished += self.structured_outputs.advance(launched.sampled, self.scheduler)  # grammars take the tokens
        rows = {id(s): i for i, s in enumerate(launched.seqs)} if logprobs else None
        changed: dict[str, list[Sequence]] = {}
        for seq, pos in work:
            if seq.logprobs is not None:
                add_logprobs(seq, seq.token_ids[pos], logprobs[rows[id(seq)]], self.tokenizer)
            if seq.detokenizer is not None:
                stop = seq.detokenizer.add(seq.output_token_ids, final=seq.is_finished)
                if stop is not None:
                    if not seq.is_finished:
                        self.scheduler.finish(seq, "stop")
                        finished.append(seq)
                    seq.finish_reason, seq.stop_reason = "stop", stop
            if seq.index == 0 and pos == seq.num_prompt_tokens and self.requests[seq.request_id].deferred:
                self._release_deferred(self.requests[seq.request_id])
            if not seq.is_finished and seq.sampling_params.output_kind != FINAL_ONLY:
                changed.setdefault(seq.request_id, []).append(seq)
        for seq in finished:
            changed.setdefault(seq.request_id, []).append(seq)
        outputs = []
        for rid, seqs in changed.items():
            request = self.requests[rid]
            output = request_output(request, seqs, self.tokenizer)
            if output is not None:
                outputs.append(output)
            if output is not None and output.finished:
                del self.requests[rid]
        launched.record.postprocess = time.perf_counter() - t
        self.step_log.append(launched.record)
        return outputs

    def _release_deferred(self, request: Request) -> None:
        """Sequence 0 has computed the prompt (its first token arrived): its full blocks are in the prefix
        cache, where the other sequences find them. They go to the front of the queue (they arrived with it)."""
        for seq in reversed(request.deferred):
            self.scheduler.add(seq, front=True)
        request.deferred = []
