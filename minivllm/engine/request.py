"""What enters and leaves the engine per request (vLLM V1's EngineCoreRequest / EngineCoreOutput): a request's
`n` sequences as the engine keeps them, and what one sequence got in one step: token ids, never text (the
front end's output processor detokenises: frontend/output_processor.py).

With prefix caching, sequences 1..n-1 of a request whose prompt fills a block wait until sequence 0 has computed
the prompt (its first token arrived): they then find its blocks in the prefix cache, so the prompt is computed
once."""

from dataclasses import dataclass, field, replace

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
    prompt_logprobs: list[tuple] | None = None  # once, on sequence 0: per prompt token after the first, as above


@dataclass(slots=True)
class EngineRequest:
    """A request in the engine: its n sequences (child i seeded seed + i, as vLLM)."""

    seqs: list[Sequence]
    deferred: list[Sequence] = field(default_factory=list)  # waiting for seqs[0] to compute the shared prompt
    prompt_rows: list[tuple] | None = None  # prompt-logprob rows of prompt tokens 1, 2, ..., when asked
    prompt_rows_sent: bool = False

    @classmethod
    def make(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> "EngineRequest":
        """The request's n sequences, child i drawing from seed + i (as vLLM)."""
        seqs = []
        for i in range(params.n):
            child = replace(params, n=1, seed=params.seed + i) if params.n > 1 and params.seed is not None else params
            child.bad_words_token_ids = params.bad_words_token_ids
            seqs.append(Sequence(prompt_token_ids, child, request_id, i))
        return cls(seqs, prompt_rows=[] if params.prompt_logprobs is not None else None)

    @property
    def num_prompt_tokens(self) -> int:
        return self.seqs[0].num_prompt_tokens

    def start(self, share_prompt: bool) -> list[Sequence]:
        """The sequences to schedule now: with `share_prompt` (prefix caching, a prompt longer than a block) the
        first only, the others deferred until it has computed the prompt (not when prompt logprobs are asked: those
        score every position)."""
        if share_prompt and self.prompt_rows is None and len(self.seqs) > 1:
            self.deferred = self.seqs[1:]
            return self.seqs[:1]
        return list(self.seqs)

    def add_prompt_rows(self, first: int, rows: list[tuple]) -> None:
        """Prompt-logprob rows of prompt tokens `first`, `first + 1`, ... (a chunk's; rows already recorded, as
        after a recompute, are skipped)."""
        if self.prompt_rows is not None and first <= len(self.prompt_rows) + 1:
            self.prompt_rows += rows[len(self.prompt_rows) + 1 - first :]

    def release(self, seq: Sequence, pos: int) -> list[Sequence]:
        """The sequences to schedule now that `seq`'s token at `pos` arrived: the deferred ones once sequence 0
        has computed the prompt (its blocks are in the prefix cache)."""
        if not self.deferred or seq.index != 0 or pos != seq.num_prompt_tokens:
            return []
        released, self.deferred = self.deferred, []
        return released
