"""The OpenAI API's request bodies as pydantic models (what /v1/completions and /v1/chat/completions accept),
with the sampling fields vLLM accepts beyond OpenAI's (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens, return_tokens_as_token_ids,
...), and their translation to SamplingParams; structured outputs from OpenAI's `response_format` or vLLM's
`structured_outputs` body field. Unknown fields are accepted and ignored, as vLLM does; a
field of the wrong type is a 400 that names it (openai_server.py)."""

from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.frontend.sampling_checks import INT64_MAX, INT64_MIN
from minivllm.frontend.structured_outputs import StructuredOutputsParams
from minivllm.sampling_params import RequestOutputKind, SamplingParams


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


# --- structured outputs: response_format and vLLM's structured_outputs (minivllm/frontend/structured_outputs) --


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # the JSON schema
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(OpenAIModel):
    """vLLM's `structured_outputs` field, its StructuredOutputsParams as JSON."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class StructuredOutputsFields(OpenAIModel):
    response_format: ResponseFormat | None = None  # OpenAI's: {"type": "json_object"} or {"type": "json_schema", ...}
    structured_outputs: StructuredOutputsBody | None = None  # vLLM's: {"choice": [...]}, {"regex": ...}, ...

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's grammar (None: free text); ValueError naming the field when it is not one."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text":
            if so is not None:
                raise ValueError("response_format and structured_outputs both constrain the output: send one")
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError('response_format of type "json_schema" needs json_schema.schema, the JSON schema')
            return StructuredOutputsParams(json=rf.json_schema.schema_)
        if so is None:
            return None
        fields = so.model_dump(by_alias=True, include={"json_", "regex", "choice", "grammar", "json_object"})
        return StructuredOutputsParams(**fields, disable_any_whitespace=so.disable_any_whitespace)


# --- sampling fields ------------------------------------------------------------------------------------


class SamplingFields(StructuredOutputsFields):
    """Fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None  # None: 1.0
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)  # vLLM's bound: it seeds an int64 generator
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias in [-100, 100]
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:N"
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams of this request (raises ValueError naming a field with a bad value). Streams get
        the new text of each step (DELTA), the others one final output."""
        return SamplingParams(
            logit_bias=token_id_keys(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            prompt_logprobs=self.prompt_logprobs,
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.structured_outputs_params(),
        )


class CompletionRequest(SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str]  # (token ids first: validated in ~5 us, not ~50)
    max_tokens: int | None = 16  # OpenAI's and vLLM's default
    logprobs: int | None = None
    echo: bool = False  # the prompt's text (and with logprobs, the prompt's logprobs) before the completion
    suffix: str | None = None  # refused when given
    best_of: int | None = None  # refused beyond n

    @property
    def score_only(self) -> bool:
        """echo with max_tokens 0: the prompt scored, nothing generated (lm-evaluation-harness sends this)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """As SamplingFields'; echo with logprobs asks for the prompt's logprobs too, and a score-only request
        runs one token that the response leaves out (as vLLM)."""
        sp = super().sampling_params(1 if self.score_only else max_tokens, logprobs)
        echo_logprobs = self.echo and logprobs is not None and sp.prompt_logprobs is None
        return replace(sp, prompt_logprobs=logprobs) if echo_logprobs else sp


def token_id_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    """logit_bias as JSON sends it (token ids as strings) -> {token id: bias}."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}") from None
    return out


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the model's length (vLLM)
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None  # refused unless --trust-request-chat-template (server_options.py)
    tools: list | None = None  # refused when given

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
