"""Per-request sampling parameters with vLLM's names, meanings and defaults: plain data. They are checked where a
request is accepted (frontend/sampling_checks.py, called by the Processor that LLM and the server run): a bad value is a
ValueError that names the field, and vLLM's other spellings are normalised there (top_k -1, a temperature below 1e-5 as
greedy). The pipeline they drive, in order: frontend/sampling_inputs.py."""

import copy
from dataclasses import dataclass, field
from enum import IntEnum


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # each output holds every token and all the text so far (vLLM's default)
    DELTA = 1  # each output holds only what is new since the last one (the server streams these)
    FINAL_ONLY = 2  # one output, when the request finishes (LLM.generate)


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
    prompt_logprobs: int | None = None  # top log-probabilities per prompt token (plus the actual one); None = off
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words never generated (a word's last token banned after the others)
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: object | None = None  # a StructuredOutputsParams (frontend/structured_outputs/params.py)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # the spellings the engine reads as one (a stop string, no stop tokens); every check is the Processor's
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's clone): changing one's lists or dicts leaves the other as it was."""
        return copy.deepcopy(self)
