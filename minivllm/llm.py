"""The user-facing class (nano-vllm's llm.py: `class LLM(LLMEngine)`), vLLM's offline API: the engine
(engine/llm_engine.py) with vLLM's front end around it (frontend/offline.py: engine arguments by vLLM's names,
prompts in every form, checks, the sampling extras, one output processor from token ids to RequestOutputs;
`generate`, `chat` and the step API that `generate` and the async engine's thread drive)."""

from minivllm.engine.llm_engine import LLMEngine
from minivllm.frontend.offline import OfflineAPI


class LLM(OfflineAPI, LLMEngine):
    pass
