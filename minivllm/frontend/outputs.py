"""What a request returns, in vLLM's shape: a RequestOutput per request holding one CompletionOutput per
sequence (`n` of them), each with its text, token ids, finish reason and, when asked, log-probabilities."""

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    logprob: float  # log-probability of the token under the raw model logits (before temperature, penalties)
    rank: int | None = None  # 1 = the most likely token; ties share the lower rank
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # per output token: {token id: Logprob} for the top-k and the sampled one
PromptLogprobs = list[dict[int, Logprob] | None]  # None (the first token has none), then one per prompt token


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n sequences
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs (None without logprobs)
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" (EOS, a stop token or string), "length", "abort"; None: running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None for EOS)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None  # when asked for (SamplingParams.prompt_logprobs)

    # read-only shortcuts to the first sequence (minivllm's older API, used by its notebooks)
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
