"""Per-request sampling parameters with vLLM's names, meanings and defaults, validated on construction (a bad
value is a ValueError that names the field).

The pipeline they drive, in order (minivllm/engine/model_runner.py, `ModelRunner.sample`): log-probabilities
of the raw logits (`logprobs`), `min_tokens` (EOS and `stop_token_ids` masked until reached), the penalties
(`repetition_penalty` over prompt + output tokens, `frequency_penalty` / `presence_penalty` over output
tokens), then temperature, `min_p`, `top_k`, `top_p`, and the draw (`seed`: the request's own random stream).
`structured_outputs` masks the logits before all of these, logprobs included as in vLLM (minivllm/structured_outputs).
On the host: `stop` strings on the detokenised text, `max_tokens`, `ignore_eos`."""

import math
from dataclasses import dataclass, field
from enum import IntEnum

from minivllm.structured_outputs.params import StructuredOutputsParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # each output holds every token and all the text so far (vLLM's default)
    DELTA = 1  # each output holds only what is new since the last one (the server streams these)
    FINAL_ONLY = 2  # one output, when the request finishes (LLM.generate)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off (-1 is accepted as off too, as vLLM does)
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability; 0 = off
    seed: int | None = None  # this request's own random stream (child i of n uses seed + i)
    stop: str | list[str] | None = None  # stop strings, matched on the text; not in the output by default
    stop_token_ids: list[int] | None = None  # stop tokens; kept in the output
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's length (max_model_len - prompt)
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted from tokens present in the output
    frequency_penalty: float = 0.0  # in [-2, 2]: times each token's count in the output
    repetition_penalty: float = 1.0  # > 0: divides (positive) / multiplies (negative) logits of seen tokens
    logprobs: int | None = None  # top log-probabilities per output token (plus the sampled one); None = off
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # the output's grammar (minivllm/structured_outputs)
    # derived (the engine reads them at every step): penalties read every previous token; anything beyond
    # temperature needs the sampling outside the decode graph
    needs_history: bool = field(default=False, init=False, repr=False, compare=False)
    needs_processing: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:  # -1 is vLLM's old spelling of off
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")  # or None
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens {self.max_tokens}, got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self.output_kind = RequestOutputKind(self.output_kind)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, got {type(so).__name__}")
        self.top_k = max(self.top_k, 0)
        if self.temperature < GREEDY_EPS:  # greedy: the filters cannot change an argmax
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when sampling greedily (temperature 0), got {self.n}")
        self.needs_history = self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        self.needs_processing = (
            self.top_k > 0
            or self.top_p < 1
            or self.min_p > 0
            or self.needs_history
            or (self.seed is not None and self.temperature > 0)
            or self.logprobs is not None
            or self.structured_outputs is not None  # the grammar's mask, on the eager path
        )
