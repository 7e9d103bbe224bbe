"""vLLM's offline API, the front end of `LLM` (llm.py): `LLM(model_dir, **engine_args)` with `generate(prompts,
sampling_params)` and `chat(messages, sampling_params)`, which queue their requests through the step API
(step_api.py: tokenized and checked, every prompt form of inputs.py) and step the engine until they are done."""

import time

from tqdm import tqdm

from minivllm.frontend.inputs import is_conversation, is_single_prompt, render_chat
from minivllm.frontend.outputs import RequestOutput
from minivllm.frontend.step_api import StepAPI
from minivllm.sampling_params import RequestOutputKind, SamplingParams


class OfflineAPI(StepAPI):
    """vLLM's offline API over an engine: `LLM` is this class over LLMEngine (llm.py)."""

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Outputs of `prompts` (one prompt or a list), in input order, when all are done. The batch is checked
        whole before anything is queued: one bad prompt refuses all, with every problem named."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
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
        t0, tokens, start = time.perf_counter(), {True: 0, False: 0}, self.step_log.mark()  # prefill, decode
        while len(outputs) < len(requests):
            for output in self.step():
                if output.finished and output.request_id in wanted:
                    outputs[output.request_id] = output
                    pbar.update(1)
            if use_tqdm:
                for record in self.step_log.since(start):
                    tokens[record.is_prefill] += record.num_tokens
                start, dt = self.step_log.mark(), max(time.perf_counter() - t0, 1e-9)
                pbar.set_postfix(
                    prefill=f"{tokens[True] / dt:.0f}tok/s", decode=f"{tokens[False] / dt:.0f}tok/s", refresh=False
                )
        pbar.close()
        return [outputs[r.request_id] for r in requests]
