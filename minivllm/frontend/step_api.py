"""vLLM's LLMEngine step API over the engine (engine/llm_engine.py), as vLLM's LLMEngine is around its engine core:
`add_request(request_id, prompt, params)`, `abort_request(ids)`, `step() -> list[RequestOutput]`. Engine arguments
take vLLM's names (engine_args.py), a request is tokenized and checked (processor.py) before the engine queues it,
the engine is given the sampling extras (sampling_extras.py), and the token ids each step emits become RequestOutputs
in the one output processor (output_processor.py). `LLM.generate` (offline.py) and the async engine's thread
(serve/async_llm.py) drive it."""

from itertools import count

from minivllm.frontend.engine_args import config_args
from minivllm.frontend.output_processor import OutputProcessor
from minivllm.frontend.outputs import RequestOutput
from minivllm.frontend.processor import Processor
from minivllm.frontend.requests import Request
from minivllm.frontend.sampling_extras import SamplingExtras
from minivllm.sampling_params import SamplingParams


class StepAPI:
    """The step API with the front end, over an engine: each method here calls the engine's own through `super()`
    (`LLM` is OfflineAPI over LLMEngine, llm.py)."""

    def __init__(self, model: str, **kwargs) -> None:
        super().__init__(model, sampling_hook=SamplingExtras, **config_args(kwargs))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.request_counter = count()

    def get_tokenizer(self):
        return self.tokenizer

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def processor(self) -> Processor:
        """Tokenizes and checks requests against this engine's limits (processor.py)."""
        return Processor.of(self.config, self.tokenizer)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request (vLLM's signature): `prompt` in any form of minivllm/frontend/inputs.py, or a Request that
        a Processor made already (in another thread, with its own tokenizer). It joins the batch at the next step.
        Raises ValueError / TypeError naming the problem; a refused request leaves nothing behind."""
        request = prompt if isinstance(prompt, Request) else self.processor.process(request_id, prompt, params)
        self.output_processor.add_request(request)  # (ValueError: the id is in use)
        try:
            super().add_request(request.request_id, request.prompt_token_ids, request.params)
        except BaseException:
            self.output_processor.abort_requests([request.request_id])
            raise

    def abort_request(self, request_id: str | list[str]) -> list[RequestOutput]:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed now. Returns their final
        outputs (finish_reason "abort")."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outputs, _ = self.output_processor.process(super().abort_request(ids))
        self.output_processor.abort_requests(ids)
        return outputs

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests that got tokens (per their output_kind). A sequence whose
        text reached a stop string ends in the engine before the next step."""
        outputs, stopped = self.output_processor.process(super().step())
        self.finish_sequences(stopped)
        return outputs
