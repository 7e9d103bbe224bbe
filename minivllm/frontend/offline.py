"""vLLM's offline API, the front end of `LLM` (llm.py): `LLM(model_dir, **engine_args)` with `generate(prompts,
sampling_params)`, `chat(messages, sampling_params)`, `get_tokenizer()` and `reset_prefix_cache()`, around the engine
(engine/llm_engine.py) as vLLM's LLMEngine is around its engine core: engine arguments take vLLM's names
(engine_args.py), a request is tokenized and checked (processor.py) before the engine queues it, the engine is given
the sampling extras (sampling_extras.py), and what each step emits (token ids) becomes RequestOutputs in the one
output processor (output_processor.py). Its step API, `add_request(request_id, prompt, params)`,
`abort_request(ids)`, `step() -> list[RequestOutput]`, is what `generate` drives until its requests are done and
what the async engine's thread drives (serve/async_llm.py). Prompts take every form of inputs.py."""

import time
from itertools import count

from tqdm import tqdm

from minivllm.frontend.engine_args import config_args
from minivllm.frontend.inputs import is_conversation, is_single_prompt, render_chat
from minivllm.frontend.output_processor import OutputProcessor
from minivllm.frontend.outputs import RequestOutput
from minivllm.frontend.processor import Processor
from minivllm.frontend.requests import Request
from minivllm.frontend.sampling_extras import SamplingExtras
from minivllm.sampling_params import RequestOutputKind, SamplingParams


class OfflineAPI:
    """vLLM's offline API over an engine: `LLM` is this class over LLMEngine (llm.py), each method here calling the
    engine's own through `super()`."""

    def __init__(self, model: str, **kwargs) -> None:
        super().__init__(model, sampling_hook=SamplingExtras, **config_args(kwargs))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.request_counter = count()

    def get_tokenizer(self):
        return self.tokenizer

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- the step API, with the front end ---------------------------------------------------------------

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

    # --- offline generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs of `prompts` (one prompt or a list), in input order, when all are done. The batch is checked
        whole before anything is queued: one bad prompt refuses all, with every problem named."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        requests, problems = [], []
        for i, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
            try:
                rid = next(r for r in map(str, self.request_counter) if r not in self.requests)
                requests.append(self.processor.process(rid, prompt, sp, output_kind=RequestOutputKind.FINAL_ONLY))
            except (ValueError, TypeError) as e:
                problems.append(f"prompt {i}: {e}")
        if problems:  # refuse the batch before anything is queued
            raise ValueError("; ".join(problems))
        for request in requests:
            self.add_request(request.request_id, request)
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to a list of them,
        each rendered by the tokenizer's chat template with the assistant's turn opened (or, with
        `continue_final_message` and add_generation_prompt=False, its last message left open to continue)."""
        conversations = [messages] if is_conversation(messages) else messages
        kwargs = dict(chat_template_kwargs or {}, continue_final_message=continue_final_message)
        prompts = [render_chat(self.tokenizer, c, add_generation_prompt, **kwargs) for c in conversations]
        # the template writes the special tokens itself (a BOS included): tokenize without adding more
        ids = [{"prompt_token_ids": self.tokenizer.encode(p, add_special_tokens=False)} for p in prompts]
        outputs = self.generate(ids, sampling_params, use_tqdm)
        for output, prompt in zip(outputs, prompts):
            output.prompt = prompt
        return outputs

    def _run(self, requests: list, use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every one of `requests` has finished; their outputs in order."""
        outputs: dict[str, RequestOutput] = {}
        wanted = {r.request_id for r in requests}
        pbar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        t0, tokens, start = time.perf_counter(), {True: 0, False: 0}, len(self.step_log)  # prefill, decode
        while len(outputs) < len(requests):
            for output in self.step():
                if output.finished and output.request_id in wanted:
                    outputs[output.request_id] = output
                    pbar.update(1)
            if use_tqdm:
                for record in self.step_log[start:]:
                    tokens[record.is_prefill] += record.num_tokens
                start, dt = len(self.step_log), max(time.perf_counter() - t0, 1e-9)
                pbar.set_postfix(
                    prefill=f"{tokens[True] / dt:.0f}tok/s", decode=f"{tokens[False] / dt:.0f}tok/s", refresh=False
                )
        pbar.close()
        return [outputs[r.request_id] for r in requests]
