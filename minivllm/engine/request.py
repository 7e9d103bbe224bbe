"""What enters and leaves the engine per request (vLLM V1's EngineCoreRequest / EngineCoreOutput): a request's
`n` sequences as the engine keeps them, and what one sequence got in one step: token ids, never text (the
front end's output processor detokenises: frontend/output_processor.py).

With prefix caching, sequences 1..n-1 of a request whose prompt fills a block wait until sequence 0 has computed
the prompt (its first token arrived): they then find its blocks in the prefix cache, so the prompt is computed
once."""

from dataclasses import dataclass, field

from minivllm.engine.sequence import Sequence


@dataclass(slots=True)
class EngineOutput:
    """What one sequence got in one step (vLLM V1's EngineCoreOutput): token ids, no text."""

    request_id: str
    index: int  # which of the request's n sequences
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS, stop token, grammar's end), "length", "abort", "error"; None: runs
    stop_reason: int | str | None = None  # the stop token id that ended it (None for EOS); "error": the message
    new_logprobs: list[tuple] | None = None  # per new token (top ids, top logprobs, logprob, rank), when asked
    prompt_logprobs: list[tuple] | None = None  # once, on sequence 0: per prompt token after the first, as above


@dataclass(slots=True)
class EngineRequest:
    """A request in the engine: its n sequences (child i seeded seed + i, as vLLM)."""

    seqs: list[Sequence]
    deferred: list[Sequence] = field(default_factory=list)  # waiting for seqs[0] to compute the shared prompt
    prompt_rows: list[tuple] | None = None  # prompt-logprob rows of prompt tokens 1, 2, ..., when asked
    prompt_rows_sent: bool = False

    def release(self, seq: Sequence, pos: int) -> list[Sequence]:
        """The sequences to schedule now that `seq`'s token at `pos` arrived: the deferred ones once sequence 0
        has computed the prompt (its blocks are in the prefix cache)."""
        if not self.deferred or seq.index != 0 or pos != seq.num_prompt_tokens:
            return []
        released, self.deferred = self.deferred, []
        return released
