"""From what a user sends to a Request the engine can queue (vLLM's Processor): the prompt tokenized, the
request checked against the engine's limits, its parameters resolved. It reads no scheduler state, so it
runs anywhere: in the engine's thread (`LLM.add_request`), in a server's event loop with its own
tokenizer (async_llm.py), or in an API-server process that knows the engine's limits only. A request that
cannot run is refused here with an error that names the problem, before it reaches the scheduler."""

from dataclasses import dataclass, replace

from minivllm.frontend.inputs import parse_prompt
from minivllm.frontend.requests import Request
from minivllm.frontend.sampling_checks import check_sampling_params
from minivllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class Processor:
    tokenizer: object  # encodes text prompts (one per thread: a tokenizer is not thread-safe)
    vocab_size: int
    max_model_len: int
    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks in the cache
    tensor_parallel_size: int = 1

    @classmethod
    def of(cls, config, tokenizer) -> "Processor":
        """The processor of an engine with this Config (its tokenizer, or another thread's own)."""
        c = config
        return cls(tokenizer, c.hf_config.vocab_size, c.max_model_len, c.kvcache_block_size, c.num_kvcache_blocks,
                   c.tensor_parallel_size)  # fmt: skip

    def process(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None = None,
        output_kind: RequestOutputKind | None = None,
    ) -> Request:
        """The request, tokenized and checked (raises ValueError / TypeError naming the problem)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        params = params if params is not None else SamplingParams()
        text, token_ids = parse_prompt(prompt)
        if token_ids is None:
            token_ids = self.tokenizer.encode(text)
        self.check(token_ids, params)
        changes = dict(output_kind=output_kind if output_kind is not None else params.output_kind)
        if params.max_tokens is None:
            changes["max_tokens"] = self.max_model_len - len(token_ids)
        if params.top_k >= self.vocab_size:  # vLLM: a top_k that keeps every token is no limit
            changes["top_k"] = 0
        params = replace(params, **changes)  # the engine's own copy
        params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words or [])
        return Request(request_id=request_id, prompt=text, prompt_token_ids=token_ids, params=params)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens, at the start of a text and after a space (vLLM's: the second only where the
        space makes other tokens of the same count)."""
        out = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(plain)
            if spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return out

    def check(self, token_ids: list[int], sp: SamplingParams) -> None:
        """Raise ValueError / TypeError naming what makes this request impossible for the engine."""
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(sp).__name__}")
        check_sampling_params(sp)  # each field (ValueError naming it); vLLM's spellings normalised
        if len(token_ids) == 0:
            raise ValueError("empty prompt: a request needs at least one token")
        v = self.vocab_size  # (the prompt's ids are Python ints, from parse_prompt or the tokenizer: min, max in C)
        prompt_ids = [] if min(token_ids) >= 0 and max(token_ids) < v else token_ids
        for name, ids in (
            ("token ids", prompt_ids),
            ("stop_token_ids", sp.stop_token_ids),
            ("logit_bias token ids", list(sp.logit_bias or {})),
            ("allowed_token_ids", sp.allowed_token_ids or []),
        ):
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < v)]
            if bad:
                raise ValueError(f"{name} {bad[:5]} are outside the vocabulary [0, {v})")
        if sp.structured_outputs is not None:  # its grammar parses (compiled against the vocabulary in the engine)
            from minivllm.frontend.structured_outputs.grammar import grammar_of  # loads xgrammar

            grammar_of(sp.structured_outputs)
        if sp.prompt_logprobs is not None and self.tensor_parallel_size > 1:
            raise ValueError("prompt_logprobs is not supported with tensor_parallel_size > 1")
        n, limit = len(token_ids), self.max_model_len
        context = f"this model's maximum context length is {limit} tokens"
        if sp.max_tokens is None and n >= limit:
            raise ValueError(no_room(n, limit))
        max_tokens = sp.max_tokens if sp.max_tokens is not None else limit - n
        total = n + max_tokens
        if total > limit:
            raise ValueError(
                f"prompt of {n} tokens + max_tokens {max_tokens} = {total} exceeds max_model_len {limit} ({context})"
            )
        blocks = -(-total // self.block_size)
        if blocks > self.num_blocks:
            raise ValueError(
                f"prompt of {n} tokens + max_tokens {max_tokens} needs {blocks} KV blocks; "
                f"the cache has only {self.num_blocks}"
            )


def no_room(num_prompt_tokens: int, max_model_len: int) -> str:
    """The error of a prompt that leaves no room for output, in vLLM's words ("maximum context length", which
    clients such as LiteLLM match on)."""
    return (
        f"prompt of {num_prompt_tokens} tokens leaves no room for output within max_model_len {max_model_len} "
        f"(this model's maximum context length is {max_model_len} tokens)"
    )
