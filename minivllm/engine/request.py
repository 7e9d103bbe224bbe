"""What enters and leaves the engine (llm_engine.py), per request and per step (vLLM V1's EngineCoreRequest /
EngineCoreOutput): a request's `n` sequences as the engine keeps them, what one sequence got in one step (token ids,
never text: the front end's output processor detokenises, frontend/output_processor.py), and a launched step
(model_runner.py's `launch`) whose sampled tokens are on their way back to the host.

A request ends alone: aborted, or failed on its own error (a grammar that does not compile, step inputs that fail to
build: finish_reason "error", the message in stop_reason), its blocks freed at once, even while a step that computes it
is in flight (that step's token for it is discarded). Only an error no request alone causes stops the engine."""

import time
from dataclasses import dataclass, field, replace

import torch

from minivllm.engine.sequence import Sequence
from minivllm.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineOutput:
    """What one sequence got in one step (vLLM V1's EngineCoreOutput): token ids, no text."""

    request_id: str
    index: int  # which of the request's n sequences
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS, stop token, grammar's end), "length", "abort", "error"; None: runs
    stop_reason: int | str | None = None  # the stop token id that ended it (None for EOS); "error": the message
    new_logprobs: list[tuple] | None = None  # per new token (top ids, top logprobs, logprob, rank), when asked
    prompt_logprobs: tuple[int, list[tuple]] | None = None  # a prefill chunk's: (first prompt index, rows as above)


@dataclass(slots=True)
class EngineRequest:
    """A request in the engine: its n sequences."""

    seqs: list[Sequence]
    deferred: list[Sequence] = field(default_factory=list)  # waiting for seqs[0] to compute the shared prompt

    @classmethod
    def make(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_model_len: int):
        """The request's n sequences, child i seeded seed + i (as vLLM); max_tokens None: up to the model's length."""
        if params.max_tokens is None:
            params = replace(params, max_tokens=max_model_len - len(prompt_token_ids))
        seqs = []
        for i in range(params.n):
            child = replace(params, n=1, seed=params.seed + i) if params.n > 1 and params.seed is not None else params
            child.bad_words_token_ids = params.bad_words_token_ids
            seqs.append(Sequence(prompt_token_ids, child, request_id, i))
        return cls(seqs)

    def start(self, share_prompt: bool) -> list[Sequence]:
        """The sequences to schedule now: with `share_prompt` (prefix caching, a prompt longer than a block) the
        first only, the others deferred until it has computed the prompt, which they then find in the prefix cache
        (not when prompt logprobs are asked: those score every position)."""
        if share_prompt and self.seqs[0].sampling_params.prompt_logprobs is None and len(self.seqs) > 1:
            self.deferred = self.seqs[1:]
            return self.seqs[:1]
        return list(self.seqs)

    def output(self, seq: Sequence, pos: int, logprobs: dict[int, tuple], row: int) -> EngineOutput:
        """What `seq` got in a step: its token at `pos` and its finish, its logprob row (batch `row` of `logprobs`)
        when asked."""
        out = EngineOutput(seq.request_id, seq.index, [seq.token_ids[pos]], seq.finish_reason, seq.stop_reason)
        if seq.sampling_params.logprobs is not None:
            out.new_logprobs = [logprobs[row]]
        return out

    def end(self, scheduler, reason: str, message: str | None = None) -> list[EngineOutput]:
        """End the request's unfinished sequences with `reason` ("abort", "error": `message` their stop_reason);
        the scheduler frees their blocks now, a token in flight for them is discarded. One output per sequence."""
        outputs = []
        for seq in self.seqs:
            if not seq.is_finished:
                scheduler.finish(seq, reason)
                outputs.append(EngineOutput(seq.request_id, seq.index, [], reason, message))
        self.deferred = []
        return outputs

    def stop(self, index: int, scheduler) -> bool:
        """End sequence `index`, whose text reached a stop string (its blocks freed now, a token in flight for it
        discarded); True when all the request's sequences have ended."""
        if not self.seqs[index].is_finished:
            scheduler.finish(self.seqs[index], "stop")
        return all(s.is_finished for s in self.seqs)

    def release(self, seq: Sequence, pos: int) -> list[Sequence]:
        """The sequences to schedule now that `seq`'s token at `pos` arrived: the deferred ones once sequence 0
        has computed the prompt (its blocks are in the prefix cache)."""
        if not self.deferred or seq.index != 0 or pos != seq.num_prompt_tokens:
            return []
        released, self.deferred = self.deferred, []
        return released


# --- requests that fail alone (the engine's step and launch call these) ---


def fail(engine, request_id: str, message: str) -> None:
    """End a request on its own error: its outputs ("error", `message`) come in the engine's next step()'s."""
    engine.failed += engine.requests.pop(request_id).end(engine.scheduler, "error", message)


def admit_compiled(engine) -> None:
    """Schedule the requests whose grammar compiled while they waited out of the scheduler (sampling hook: a
    thread compiles it, the other requests' steps go on), and fail those whose grammar did not compile."""
    idle = engine.in_flight is None and engine.scheduler.is_finished()  # only grammars compiling: wait a little
    for rid, error in engine.sampling_hook.ready(wait=0.05 if idle else 0.0):
        if rid in engine.requests:  # (not aborted meanwhile)
            if error:
                fail(engine, rid, f"its grammar failed to compile: {error}")
            else:
                engine.schedule(engine.requests[rid])


def launch_alone_at_fault(engine, seqs: list[Sequence], is_prefill: bool) -> tuple[list[Sequence], "StepHandle"]:
    """Launch a step (model_runner.py: `launch`). When that fails, fail the requests whose own inputs fail (the
    sampling hook prepares each request's step alone) and launch the sequences left (none: no handle); re-raise
    when no request alone is at fault."""
    r, hook = engine.model_runner, engine.sampling_hook
    try:
        return seqs, r.launch(seqs, is_prefill, hook)
    except Exception:
        prepare = r.prepare_prefill if is_prefill else r.prepare_decode
        culprits = hook.failing_requests(seqs, prepare, r.buffers, r.device) if hook is not None else {}
        if not culprits or engine.workers is not None:  # (TP workers may have started the step: none left out)
            raise
        for rid, e in culprits.items():
            fail(engine, rid, f"preparing its step failed: {type(e).__name__}: {e}")
    seqs = [s for s in seqs if not s.is_finished]
    return seqs, r.launch(seqs, is_prefill, hook) if seqs else None


# --- a launched step ---


class StepHandle:
    """A launched step: `result()` waits for its sampled tokens (one per sequence) and returns them, with the
    log-probabilities of the rows that asked for them ({row: (top ids, top logprobs, logprob, rank)})."""

    def __init__(self, tokens: torch.Tensor, host: torch.Tensor | None, logprobs=None):
        # `tokens` may be a view of `last_sampled`, which the next step overwrites: take the values now
        self.n = tokens.shape[0]
        self.tokens, self.host, self.event = tokens if host is not None else tokens.clone(), host, None
        self.logprobs = logprobs  # the sampling hook's LogprobsTensors (frontend/logprobs.py), or None
        self.prompt_logprobs = None  # (plan, scored) of the rows that asked, from the sampling hook
        if host is not None:  # GPU: copy back without waiting (ordered before the next step's writes)
            host[: self.n].copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> tuple[list[int], dict[int, tuple]]:
        if self.event is not None:  # GPU: wait for the copy into the pinned host buffer
            self.event.synchronize()
        tokens = self.tokens.tolist() if self.event is None else self.host[: self.n].tolist()
        return tokens, self.logprobs.tolists() if self.logprobs is not None else {}


@dataclass(slots=True)
class StepRecord:
    """Where one step's wall time went (host seconds; `run` includes the GPU work, which it waits for): a record of
    the engine's `step_log` (a StepLog), which `LLM.generate`'s progress bar and the benchmarks read."""

    is_prefill: bool
    num_seqs: int
    num_tokens: int
    schedule: float
    run: float
    postprocess: float

    @classmethod
    def of(cls, seqs: list[Sequence], is_prefill: bool, t0: float, t1: float) -> "StepRecord":
        """A step scheduled from t0, launched from t1 until now (perf_counter seconds); postprocess comes later."""
        num_tokens = sum(s.num_scheduled_tokens for s in seqs)
        return cls(is_prefill, len(seqs), num_tokens, t1 - t0, time.perf_counter() - t1, 0.0)


class StepLog:
    """The engine's StepRecords, oldest first. An engine may step for days (a server, an `LLM` kept by a training
    loop): past `limit` records the older ones are dropped, the newest `limit // 2` kept. A reader takes `mark()`
    (the steps logged so far, dropped ones included) and later reads `since(mark)`, the records of the steps after
    it that are still kept: a drop in between does not shift them, as a position in the list would."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit, self.dropped, self.records = limit, 0, []

    def append(self, record: StepRecord) -> None:
        self.records.append(record)
        if len(self.records) > self.limit:
            cut = len(self.records) - self.limit // 2
            del self.records[:cut]
            self.dropped += cut

    def mark(self) -> int:
        return self.dropped + len(self.records)

    def since(self, mark: int) -> list[StepRecord]:
        return self.records[max(0, mark - self.dropped) :]

    def __len__(self) -> int:  # the records kept
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def __getitem__(self, index):
        return self.records[index]


@dataclass(slots=True)
class Launched:
    """A step launched on the device whose tokens have not been read back yet."""

    seqs: list[Sequence]
    sampled: list[tuple[Sequence, int]]  # (sequence, position of its PENDING token)
    handle: StepHandle
    record: StepRecord
