"""A request as the front end hands it to the engine (vLLM's EngineCoreRequest): tokenized and checked by the
Processor (processor.py), its parameters resolved (max_tokens, output kind, bad words' token ids). The engine
makes its `n` sequences (llm_engine.py); the output processor (output_processor.py) turns what they get into
RequestOutputs."""

from dataclasses import dataclass

from minivllm.sampling_params import SamplingParams


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    params: SamplingParams  # the engine's copy (max_tokens resolved)
