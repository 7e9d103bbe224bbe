"""The engine's sampling hook (sampling_hook.py: its calls), implemented: everything a request may ask of
the sampler beyond nano-vllm's temperature, gathered behind the one object the engine is given. Each concern
keeps its own module: the step's tensors and the draw (sampling_inputs.py, with penalties.py,
logits_processors.py, logprobs.py), prompt log-probabilities (prompt_logprobs.py) and grammars
(structured_outputs/)."""

import torch

from minivllm.engine.request import EngineOutput
from minivllm.engine.sequence import Sequence
from minivllm.frontend import prompt_logprobs
from minivllm.frontend.penalties import needs_history
from minivllm.frontend.sampling_inputs import SamplingInputs, failing_requests, prepare_sampling, sample_tokens
from minivllm.frontend.structured_outputs.manager import StructuredOutputs


class SamplingExtras:
    def __init__(self, *, tokenizer, vocab_size: int, eos: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos = list(eos)  # masked while a request is below its min_tokens
        self.structured_outputs = StructuredOutputs(tokenizer, vocab_size, self.eos)

    # --- the engine ---

    def add_request(self, request_id: str, seqs: list[Sequence]) -> bool:
        return self.structured_outputs.submit(request_id, seqs)  # a grammar compiles in a thread meanwhile

    def ready(self, wait: float = 0.0) -> list[tuple[str, Exception | None]]:
        return self.structured_outputs.ready(wait)

    @property
    def num_waiting(self) -> int:
        return len(self.structured_outputs.pending)

    def shutdown(self) -> None:
        self.structured_outputs.shutdown()  # grammars still compiling are dropped

    def failing_requests(self, seqs: list[Sequence], prepare_inputs, buffers, device) -> dict[str, Exception]:
        kw = dict(device=device, eos=self.eos, vocab=self.vocab_size)
        return failing_requests(seqs, prepare_inputs, buffers, **kw)

    def prompt_logprobs_outputs(self, seqs: list[Sequence], plan, scored) -> list[EngineOutput]:
        return prompt_logprobs.outputs(seqs, plan, scored)

    def needs_history(self, seqs: list[Sequence]) -> bool:
        return any(needs_history(s.sampling_params) or s.sampling_params.structured_outputs for s in seqs)

    def advance(self, sampled: list[tuple[Sequence, int]], finish) -> list[Sequence]:
        return self.structured_outputs.advance(sampled, finish)  # grammars take the tokens

    # --- the model runner ---

    def prepare(self, seqs: list[Sequence], buffers, *, device: torch.device, in_graph: bool) -> SamplingInputs | None:
        return prepare_sampling(seqs, buffers, device=device, eos=self.eos, vocab=self.vocab_size, in_graph=in_graph)

    def is_plain(self, batch: SamplingInputs) -> bool:
        return batch.plain

    def sample(self, sampler, logits: torch.Tensor, batch: SamplingInputs):
        return sample_tokens(sampler, logits, batch)

    def plan_prompt_logprobs(self, seqs: list[Sequence]) -> prompt_logprobs.PromptScoring | None:
        return prompt_logprobs.plan(seqs)

    def score_prompt_logprobs(self, lm_head, hidden: torch.Tensor, plan: prompt_logprobs.PromptScoring):
        return prompt_logprobs.score(lm_head, hidden, plan)
