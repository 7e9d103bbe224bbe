"""The engine (nano-vllm's llm_engine.py), vLLM V1's engine core: it schedules and runs steps and emits token ids.
Each `step()` returns an `EngineOutput` (request.py) for every sequence that got a token: new token ids, finish
reason, raw logprob rows, no text. Its drivers, `LLM` (llm.py) and the serving engine core (serve/core.py), check
requests before `add_request` and turn outputs into RequestOutputs in one output processor (frontend/); the
sampling extras reach the engine through the one hook it is given (frontend/sampling_hook.py).

One step ahead (the engine's speed on a GPU). `step()` schedules, prepares and launches step N+1 while step N still
runs on the GPU, the sequences' newest tokens being PENDING placeholders on the host that the GPU feeds in from step
N's output (step_inputs.py); only then does it read step N's tokens back and turn them into outputs. The host work
of a step hides behind the GPU work of the previous one. The launch waits for the step in flight instead when the
next step needs its tokens on the host: with tensor parallelism (the workers receive each step's token ids from
rank 0), and when a request in flight has penalties, bad words or a grammar (they read every previous token of the
request). Aborts, stop strings and requests that fail alone: request.py."""

import atexit
import time
import weakref
from collections.abc import Callable

from minivllm.checkpoint import eos_token_ids, load_tokenizer
from minivllm.config import Config
from minivllm.engine import request as per_request  # requests that fail alone
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.request import EngineOutput, EngineRequest, Launched, StepLog, StepRecord
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.tp_workers import Workers, free_port
from minivllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, model: str, sampling_hook: Callable | None = None, **kwargs) -> None:
        """An engine on `model` (engine arguments in kwargs). `sampling_hook(tokenizer=, vocab_size=, eos=)` makes
        the hook of the sampling extras (its calls: frontend/sampling_hook.py); without one the engine samples by
        temperature only."""
        self.config = config = Config(model, **kwargs)
        port = free_port()
        self.workers = Workers(config, port, ModelRunner) if config.tensor_parallel_size > 1 else None
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
        self.sampling_hook = make_hook(**kw) if make_hook is not None else None
        self.requests: dict[str, EngineRequest] = {}  # unfinished, by id
        self.in_flight: Launched | None = None
        self.failed: list[EngineOutput] = []  # outputs of requests that failed alone, for the next step() to return
        self.overlap = config.tensor_parallel_size == 1  # TP workers need each step's tokens on the host
        self.step_log = StepLog()  # where each step's time went (bounded: an engine may step for days)
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
        request = EngineRequest.make(request_id, prompt_token_ids, params, self.config.max_model_len)
        self.requests[request_id] = request
        # sampling hook: a request with a grammar waits out of the scheduler while a thread compiles it
        if self.sampling_hook is None or not self.sampling_hook.add_request(request_id, request.seqs):
            self.schedule(request)

    def schedule(self, request: EngineRequest) -> None:
        """Hand a request's sequences to the scheduler (those that must wait for the first one's prompt wait)."""
        share = self.config.enable_prefix_caching and request.seqs[0].num_prompt_tokens > self.config.kvcache_block_size
        for seq in request.start(share_prompt=share):
            self.scheduler.add(seq)

    def abort_request(self, request_id: str | list[str]) -> list[EngineOutput]:
        """Abort requests (unknown or finished ids are ignored): their sequences leave the batch and their
        blocks are freed now, wherever they are (waiting, running, or in the step in flight). Returns an
        "abort" output for each sequence it ended."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        ended = [self.requests.pop(rid) for rid in ids if rid in self.requests]
        return [out for request in ended for out in request.end(self.scheduler, "abort")]

    def finish_sequences(self, targets: list[tuple[str, int]]) -> None:
        """End sequences (request id, index) that the front end saw reach a stop string; their blocks are freed
        now, a token in flight for them is discarded. A request whose sequences have all ended leaves."""
        for rid, index in targets:
            if rid in self.requests and self.requests[rid].stop(index, self.scheduler):
                del self.requests[rid]

    def has_unfinished_requests(self) -> bool:
        """Requests not finished yet, or a step still in flight (whose tokens step() reads back)."""
        return bool(self.requests) or self.in_flight is not None

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
        if hook is not None:  # sampling hook: requests whose grammar compiled join, those it failed to end
            per_request.admit_compiled(self)
        outputs, progressed = [], False
        # sampling hook: a request in flight with penalties, bad words or a grammar reads every previous token
        waits = hook is not None and self.in_flight is not None and hook.needs_history(self.in_flight.seqs)
        if self.in_flight is not None and (not self.overlap or waits):
            in_flight, self.in_flight = self.in_flight, None  # the next launch needs its tokens
            outputs, progressed = self._finish(in_flight), True
        launched = self._launch() if self.requests else None
        if self.in_flight is not None:
            outputs += self._finish(self.in_flight)
            progressed = True
        self.in_flight = launched
        failed, self.failed = self.failed, []
        if launched is None and self.requests and not (progressed or failed or (hook and hook.num_waiting)):
            raise RuntimeError("scheduler produced an empty step while requests are pending")
        return outputs + failed

    def _launch(self) -> Launched | None:
        """Schedule one step and launch it without waiting; its StepRecord counts the step's tokens, so it is made
        before `on_launch` spends them. None when nothing can be scheduled now."""
        t0 = time.perf_counter()
        seqs = self.scheduler.schedule()
        if not seqs:
            return None
        is_prefill = any(s.num_scheduled_tokens != 1 or s.num_computed_tokens != s.num_tokens - 1 for s in seqs)
        t1 = time.perf_counter()
        seqs, handle = per_request.launch_alone_at_fault(self, seqs, is_prefill)  # without requests at fault alone
        if not seqs:
            return None
        record = StepRecord.of(seqs, is_prefill, t0, t1)  # (before on_launch, which spends the scheduled tokens)
        sampled = self.scheduler.on_launch(seqs)
        return Launched(seqs, sampled, handle, record)

    def _finish(self, launched: Launched) -> list[EngineOutput]:
        """Wait for a launched step's tokens, account them (scheduler.postprocess's two halves), and report
        what each sequence got."""
        t = time.perf_counter()  # postprocess includes the wait for the GPU (StepRecord: where the wall time went)
        tokens, logprobs = launched.handle.result()
        outputs = []
        if launched.handle.prompt_logprobs is not None:  # sampling hook: the prompt logprobs a prefill step scored
            outputs = self.sampling_hook.prompt_logprobs_outputs(launched.seqs, *launched.handle.prompt_logprobs)
        live = [(seq, pos) for seq, pos in launched.sampled if not seq.is_finished]  # an aborted one's is dropped
        self.scheduler.on_result(launched.seqs, launched.sampled, tokens)
        if self.sampling_hook is not None:  # sampling hook: grammars take the tokens (one may end its sequence)
            self.sampling_hook.advance(live, self.scheduler.finish)
        row_of = {id(s): i for i, s in enumerate(launched.seqs)}
        for seq, pos in live:
            request = self.requests[seq.request_id]
            for other in reversed(request.release(seq, pos)):  # they arrived with it: the front of the queue
                self.scheduler.add(other, front=True)
            outputs.append(request.output(seq, pos, logprobs, row_of[id(seq)]))
        for rid in {out.request_id for out in outputs if out.finish_reason is not None}:
            if all(s.is_finished for s in self.requests[rid].seqs):
                del self.requests[rid]
        launched.record.postprocess = time.perf_counter() - t
        self.step_log.append(launched.record)
        return outputs
