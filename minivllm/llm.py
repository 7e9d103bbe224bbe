"""The user-facing class: `LLM(model_dir, **engine_args).generate(prompts, SamplingParams(...))`."""

from minivllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    pass
