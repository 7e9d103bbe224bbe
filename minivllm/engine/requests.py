"""A request as the engine sees it (vLLM's Request): its `n` sequences, the checks that refuse an impossible
one before it is queued, and the outputs it reports (vLLM's RequestOutput, with the text held back where a
stop string may start, log-probabilities, and for streaming only what is new)."""

from dataclasses import dataclass

from transformers import GenerationConfig

from minivllm.config import Config
from minivllm.engine.sequence import Sequence
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

FINAL_ONLY, DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # the engine's copy (max_tokens resolved)
    seqs: list[Sequence]  # n of them
    deferred: list[Sequence]  # not yet scheduled: waiting for seqs[0] to compute the shared prompt

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def eos_token_ids(model: str, tokenizer) -> list[int]:
    ids = set()
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def check_request(config: Config, vocab_size: int, token_ids: list[int], sp: SamplingParams) -> None:
    """Raise ValueError / TypeError naming what makes this request impossible for the engine."""
    c = config
    if not isinstance(sp, SamplingParams):
        raise TypeError(f"sampling params must be a SamplingParams, got {type(sp).__name__}")
    if len(token_ids) == 0:
        raise ValueError("empty prompt: a request needs at least one token")
    bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    bad = [t for t in sp.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if sp.max_tokens is None and len(token_ids) >= c.max_model_len:
        raise ValueError(
            f"prompt of {len(token_ids)} tokens leaves no room for output within max_model_len {c.max_model_len}"
        )
    max_tokens = sp.max_tokens if sp.max_tokens is not None else c.max_model_len - len(token_ids)
    total = len(token_ids) + max_tokens
    if total > c.max_model_len:
        raise ValueError(
            f"prompt of {len(token_ids)} tokens + max_tokens {max_tokens} = {total} exceeds "
            f"max_model_len {c.max_model_len}"
        )
    blocks = (total + c.kvcache_block_size - 1) // c.kvcache_block_size
    if blocks > c.num_kvcache_blocks:
        raise ValueError(
            f"prompt of {len(token_ids)} tokens + max_tokens {max_tokens} needs {blocks} KV blocks; "
            f"the cache has only {c.num_kvcache_blocks}"
        )


# --- outputs ---------------------------------------------------------------------------------------------


def add_logprobs(seq: Sequence, token: int, entry: tuple, tokenizer) -> None:
    """Append one step's log-probabilities (the sampled token first, as vLLM, then the top-k with ranks)."""
    top_ids, top_logprobs, logprob, rank = entry
    k = seq.sampling_params.logprobs
    decode = lambda t: tokenizer.decode([t])
    step = {token: Logprob(logprob, rank, decode(token))}  # the sampled token first, as vLLM
    for r, (t, lp) in enumerate(zip(top_ids[:k], top_logprobs[:k]), start=1):
        step[t] = Logprob(lp, r, decode(t))
    seq.logprobs.append(step)
    seq.cumulative_logprob += logprob


def completion(seq: Sequence, tokenizer) -> CompletionOutput:
    """Everything `seq` has produced so far (the text held back where a stop string may start)."""
    sp, done = seq.sampling_params, seq.is_finished
    ids = seq.output_token_ids
    if seq.detokenizer is not None:
        text = seq.detokenizer.visible(done)
    else:  # decoded once, at the end (FINAL_ONLY without stop strings)
        text = tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=ids,
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )


def request_output(request: Request, changed: list[Sequence], tokenizer) -> RequestOutput | None:
    """The request's output after a step in which `changed` got tokens: None while a FINAL_ONLY request
    runs; for DELTA only what is new (changed sequences only); else everything so far."""
    kind, finished = request.params.output_kind, request.finished
    if kind == FINAL_ONLY and not finished:
        return None
    if kind != DELTA:
        completions = [completion(s, tokenizer) for s in request.seqs]
    else:
        completions = []
        for seq in sorted(changed, key=lambda s: s.index):
            c = completion(seq, tokenizer)
            tokens, chars = seq.num_sent_tokens, seq.num_sent_chars
            seq.num_sent_tokens, seq.num_sent_chars = len(c.token_ids), len(c.text)
            c.token_ids, c.text = c.token_ids[tokens:], c.text[chars:]
            c.logprobs = c.logprobs[tokens:] if c.logprobs is not None else None
            completions.append(c)
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished)
