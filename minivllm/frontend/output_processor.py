"""The one output path (vLLM V1's OutputProcessor): the engine emits token ids (llm_engine.py: EngineOutput, per
sequence and step); this turns them into vLLM's RequestOutputs, for `LLM` (llm.py) and the server alike (in
AsyncLLM's engine thread, or in the API-server process from the engine core's messages). Per sequence: its
tokens, its log-probabilities with their decoded tokens, its text (detokenizer.py: incremental, with stop
strings); per request: its prompt log-probabilities, gathered as the engine scores the prompt chunk by chunk
and given out with its first token, and its `n` sequences merged into one RequestOutput in the request's output kind
(CUMULATIVE: everything so far; DELTA: only what is new; FINAL_ONLY: one output at the end). A sequence whose
text reached a stop string is reported back (`process`'s second result), for the engine to end it.

What an output holds (vLLM's rules): the text never holds the EOS or stop token that ended a sequence (whatever
skip_special_tokens) unless include_stop_str_in_output; nor a stop string (unless the same). A FINAL_ONLY
request without stop strings decodes its text once, at the end."""

from dataclasses import dataclass, field

from minivllm.engine.request import EngineOutput
from minivllm.frontend.detokenizer import Detokenizer
from minivllm.frontend.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from minivllm.frontend.requests import Request
from minivllm.sampling_params import RequestOutputKind, SamplingParams

FINAL_ONLY, DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA


@dataclass(slots=True)
class SequenceState:
    """One of a request's sequences as the front end sees it."""

    index: int
    params: SamplingParams
    detokenizer: Detokenizer | None  # text at every step (stop strings, streaming); else decoded at the end
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None  # per output token, when asked
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # tokens / characters already returned (DELTA)
    num_sent_chars: int = 0

    def text_token_ids(self) -> list[int]:
        """The output tokens whose text the output holds: not the EOS or stop token that ended it."""
        return self.token_ids[:-1] if self.ended_on_token(self.finish_reason, self.stop_reason) else self.token_ids

    def ended_on_token(self, finish_reason: str | None, stop_reason: int | str | None) -> bool:
        return (
            finish_reason == "stop" and not isinstance(stop_reason, str) and not self.params.include_stop_str_in_output
        )


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SequenceState]
    prompt_rows: list[tuple] | None = None  # prompt-logprob rows of prompt tokens 1, 2, ... as chunks arrive
    prompt_logprobs: PromptLogprobs | None = None  # once the engine has scored the prompt (its first token came)
    prompt_logprobs_sent: bool = False  # DELTA: sent with the first output that has them

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # noqa: SIM110 (a loop: all() over a generator costs more, read twice a step a stream)
            if s.finish_reason is None:
                return False
        return True

    def add_prompt_rows(self, first: int, rows: list[tuple]) -> None:
        """A chunk's prompt-logprob rows, of prompt tokens `first`, `first + 1`, ... (rows already gathered, as
        after a recompute, are skipped)."""
        if self.prompt_logprobs is None and first <= len(self.prompt_rows) + 1:
            self.prompt_rows += rows[len(self.prompt_rows) + 1 - first :]


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}  # unfinished, by id

    def add_request(self, request: Request) -> None:
        """Follow a request the engine is about to queue (ValueError: its id is in use)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        sp, seqs = request.params, []
        for i in range(sp.n):
            detokenizer = Detokenizer(self.tokenizer, sp) if sp.stop or sp.output_kind != FINAL_ONLY else None
            seqs.append(SequenceState(i, sp, detokenizer, logprobs=[] if sp.logprobs is not None else None))
        self.requests[request.request_id] = RequestState(
            request.request_id, request.prompt, request.prompt_token_ids, sp, seqs
        )
        if sp.prompt_logprobs is not None:
            self.requests[request.request_id].prompt_rows = []

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop following these requests (their outputs, if any come, are dropped)."""
        for rid in request_ids:
            self.requests.pop(rid, None)

    def process(self, outputs: list[EngineOutput]) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """One engine step's outputs -> the RequestOutputs of the requests that changed (per their output kind),
        and the sequences (request id, index) whose text reached a stop string, which the engine must end."""
        changed: dict[str, tuple[RequestState, list[SequenceState]]] = {}
        stopped = []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None or state.seqs[out.index].finish_reason is not None:
                continue  # aborted, or ended on a stop string while the engine had tokens in flight
            if out.prompt_logprobs is not None:  # a prefill chunk's prompt log-probabilities, no token
                state.add_prompt_rows(*out.prompt_logprobs)
                continue
            seq = state.seqs[out.index]
            if self.update(state, seq, out):
                stopped.append((out.request_id, out.index))
            entry = changed.get(out.request_id)
            if entry is None:
                changed[out.request_id] = (state, [seq])
            else:
                entry[1].append(seq)
        request_outputs = []
        for rid, (state, seqs) in changed.items():
            output = self.request_output(state, seqs)
            if output is not None:
                request_outputs.append(output)
            if state.finished:
                del self.requests[rid]
        return request_outputs, stopped

    def update(self, state: RequestState, seq: SequenceState, out: EngineOutput) -> bool:
        """Apply one EngineOutput to its sequence; True when a stop string ended it here (not the engine)."""
        if state.prompt_rows is not None and state.prompt_logprobs is None and seq.index == 0 and out.new_token_ids:
            k, targets = state.params.prompt_logprobs, state.prompt_token_ids[1:]  # the prompt is scored: its rows
            state.prompt_logprobs = [None] + [self.entry(t, e, k) for t, e in zip(targets, state.prompt_rows)]
        seq.token_ids += out.new_token_ids
        if seq.logprobs is not None and out.new_logprobs:
            for token, row in zip(out.new_token_ids, out.new_logprobs):
                seq.logprobs.append(self.entry(token, row, seq.params.logprobs))
                seq.cumulative_logprob += row[2]
        stop = None
        if seq.detokenizer is not None and (out.new_token_ids or out.finish_reason):
            ids = out.new_token_ids
            if ids and seq.ended_on_token(out.finish_reason, out.stop_reason):
                ids = ids[:-1]  # the EOS or stop token that ended it has no text here
            stop = seq.detokenizer.add(ids, final=out.finish_reason is not None)
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
            return out.finish_reason is None
        if out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        return False

    def entry(self, token: int, row: tuple, k: int) -> dict[int, Logprob]:
        """{token id: Logprob}: the actual token first, as vLLM, then the top-k with their ranks (row: top ids, top
        logprobs, the token's logprob, its rank)."""
        top_ids, top_logprobs, logprob, rank = row
        step = {token: Logprob(logprob, rank, self.tokenizer.decode([token]))}
        for r, (t, lp) in enumerate(zip(top_ids[:k], top_logprobs[:k]), start=1):
            step[t] = Logprob(lp, r, self.tokenizer.decode([t]))
        return step

    # --- the one RequestOutput builder -------------------------------------------------------------------

    def request_output(self, state: RequestState, changed: list[SequenceState]) -> RequestOutput | None:
        """The request's output after a step in which `changed` got something: None while a FINAL_ONLY request
        runs; for DELTA what is new in the changed sequences; else every sequence so far."""
        kind, finished = state.params.output_kind, state.finished
        if kind == FINAL_ONLY and not finished:
            return None
        if kind == DELTA:
            in_order = changed if len(changed) == 1 else sorted(changed, key=lambda s: s.index)
            completions = [self.delta(s) for s in in_order]
        else:
            completions = [self.completion(s) for s in state.seqs]
        prompt_logprobs = None if kind == DELTA and state.prompt_logprobs_sent else state.prompt_logprobs
        state.prompt_logprobs_sent = state.prompt_logprobs is not None
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
        )

    def completion(self, seq: SequenceState) -> CompletionOutput:
        """Everything `seq` has produced so far (the text held back where a stop string may start)."""
        done = seq.finish_reason is not None
        if seq.detokenizer is not None:
            text = seq.detokenizer.visible(done)
        else:  # decoded once, at the end (FINAL_ONLY without stop strings)
            text = self.tokenizer.decode(seq.text_token_ids(), skip_special_tokens=seq.params.skip_special_tokens)
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(seq.token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def delta(self, seq: SequenceState) -> CompletionOutput:
        """What is new in `seq` since its last output (DELTA; a DELTA request always has a detokenizer). Only the
        new part is copied: a streamed token costs the same at the 10th token and the 10,000th."""
        tokens, chars = seq.num_sent_tokens, seq.num_sent_chars
        text = seq.detokenizer.visible_since(chars, seq.finish_reason is not None)
        seq.num_sent_tokens, seq.num_sent_chars = len(seq.token_ids), chars + len(text)
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=seq.token_ids[tokens:],
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=seq.logprobs[tokens:] if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
