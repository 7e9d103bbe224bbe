"""A request as the engine sees it (vLLM's Request), and what it reports (vLLM's output processor): its `n`
sequences, and at each of their new tokens the log-probabilities, the text (held back where a stop string may
start, without the text of the token that ended it), the stop string found, the sequences that wait for the
first one's prompt, and the RequestOutput of its output kind (for streaming only what is new).

With prefix caching, sequences 1..n-1 of a request whose prompt fills a block wait until sequence 0 has computed
the prompt (its first token arrived): they then find its blocks in the prefix cache, so the prompt is computed
once."""

from dataclasses import dataclass, field

from minivllm.engine.sequence import Sequence
from minivllm.frontend.detokenizer import Detokenizer
from minivllm.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

FINAL_ONLY, DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # the engine's copy (max_tokens resolved)
    seqs: list[Sequence]  # n of them
    deferred: list[Sequence] = field(default_factory=list)  # waiting for seqs[0] to compute the shared prompt
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # [None, then one per prompt token]
    prompt_logprobs_sent: bool = False  # DELTA: sent with the first output

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def start(self, tokenizer, share_prompt: bool) -> list[Sequence]:
        """Set up each sequence's per-token output work; returns the sequences to schedule now (with
        `share_prompt`, sequence 0 only: the others wait for its prompt's blocks)."""
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        for seq in self.seqs:
            sp = seq.sampling_params
            if sp.stop or sp.output_kind != FINAL_ONLY:
                seq.detokenizer = Detokenizer(tokenizer, sp)
            if sp.logprobs is not None:
                seq.logprobs = []
            seq.output_work = seq.detokenizer is not None or seq.logprobs is not None
        if share_prompt and len(self.seqs) > 1:
            self.deferred = self.seqs[1:]
            self.seqs[0].output_work = True  # its first token releases them
            return self.seqs[:1]
        return list(self.seqs)

    def on_token(self, seq: Sequence, pos: int, entry: tuple | None, tokenizer) -> str | None:
        """The token at `pos` of `seq` arrived (`entry`: its logprobs row, when asked for): record its
        log-probabilities and text. Returns the stop string the text now holds, if any (the engine finishes
        the sequence; its text is already cut there)."""
        if seq.logprobs is not None:
            add_logprobs(seq, seq.token_ids[pos], entry, tokenizer)
        if seq.detokenizer is None:
            return None
        stop = seq.detokenizer.add(text_token_ids(seq), final=seq.is_finished)
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
        return stop

    def release(self, seq: Sequence, pos: int) -> list[Sequence]:
        """The sequences to schedule now that `seq`'s token at `pos` arrived: the deferred ones once sequence
        0 has computed the prompt (its blocks are in the prefix cache)."""
        if not self.deferred or seq.index != 0 or pos != seq.num_prompt_tokens:
            return []
        released, self.deferred = self.deferred, []
        return released

    def add_prompt_logprobs(self, first: int, entries: list[tuple], tokenizer) -> None:
        """Log-probabilities of prompt tokens `first`, `first + 1`, ... (a chunk's; those already recorded, as
        after a recompute, are skipped)."""
        for i, entry in enumerate(entries, start=first):
            if i == len(self.prompt_logprobs):
                token, k = self.prompt_token_ids[i], self.params.prompt_logprobs
                self.prompt_logprobs.append(logprob_entry(token, entry, k, tokenizer))

    def output(self, changed: list[Sequence], tokenizer) -> RequestOutput | None:
        """The request's output after a step in which `changed` got tokens: None while a FINAL_ONLY request
        runs; for DELTA only what is new (changed sequences only); else everything so far."""
        kind, finished = self.params.output_kind, self.finished
        if kind == FINAL_ONLY and not finished:
            return None
        completions = completions_of(self.seqs, changed, kind, tokenizer)
        prompt_logprobs = None if kind == DELTA and self.prompt_logprobs_sent else self.prompt_logprobs
        self.prompt_logprobs_sent = True
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, completions, finished, prompt_logprobs=prompt_logprobs
        )


# --- one sequence's outputs ------------------------------------------------------------------------------
# `seq` below is an engine Sequence, or the API server's view of one (output_processor.Child): both have
# output_token_ids, is_finished, finish_reason, stop_reason, sampling_params, detokenizer, logprobs,
# cumulative_logprob and the DELTA counters num_sent_tokens / num_sent_chars.


def completions_of(seqs: list, changed: list, kind: RequestOutputKind, tokenizer) -> list[CompletionOutput]:
    """A request's completions in its output kind: every sequence's output so far, or for DELTA what is new in
    the sequences that got tokens (`changed`)."""
    if kind != DELTA:
        return [completion(s, tokenizer) for s in sorted(seqs, key=lambda s: s.index)]
    completions = []
    for seq in sorted(changed, key=lambda s: s.index):
        c = completion(seq, tokenizer)
        tokens, chars = seq.num_sent_tokens, seq.num_sent_chars
        seq.num_sent_tokens, seq.num_sent_chars = len(c.token_ids), len(c.text)
        c.token_ids, c.text = c.token_ids[tokens:], c.text[chars:]
        c.logprobs = c.logprobs[tokens:] if c.logprobs is not None else None
        completions.append(c)
    return completions


def text_token_ids(seq, finish_reason: str | None = None, stop_reason: int | str | None = None) -> list[int]:
    """The output tokens whose text the output holds: not the EOS or stop token that ended it (vLLM's rule,
    whatever skip_special_tokens), unless include_stop_str_in_output. The finish reason is the sequence's, or
    the one given (the step that is finishing it)."""
    ids = seq.output_token_ids
    finish_reason, stop_reason = (finish_reason, stop_reason) if finish_reason else (seq.finish_reason, seq.stop_reason)
    ended_on_token = finish_reason == "stop" and not isinstance(stop_reason, str)
    return ids[:-1] if ended_on_token and not seq.sampling_params.include_stop_str_in_output else ids


def logprob_entry(token: int, entry: tuple, k: int, tokenizer) -> dict[int, Logprob]:
    """{token id: Logprob}: the actual token first, as vLLM, then the top-k with their ranks."""
    top_ids, top_logprobs, logprob, rank = entry
    step = {token: Logprob(logprob, rank, tokenizer.decode([token]))}
    for r, (t, lp) in enumerate(zip(top_ids[:k], top_logprobs[:k]), start=1):
        step[t] = Logprob(lp, r, tokenizer.decode([t]))
    return step


def add_logprobs(seq: Sequence, token: int, entry: tuple, tokenizer) -> None:
    """Append one step's log-probabilities (the sampled token first, then the top-k with ranks)."""
    seq.logprobs.append(logprob_entry(token, entry, seq.sampling_params.logprobs, tokenizer))
    seq.cumulative_logprob += entry[2]


def completion(seq: Sequence, tokenizer) -> CompletionOutput:
    """Everything `seq` has produced so far (the text held back where a stop string may start)."""
    sp, done = seq.sampling_params, seq.is_finished
    if seq.detokenizer is not None:
        text = seq.detokenizer.visible(done)
    else:  # decoded once, at the end (FINAL_ONLY without stop strings)
        text = tokenizer.decode(text_token_ids(seq), skip_special_tokens=sp.skip_special_tokens)
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=seq.output_token_ids,
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
