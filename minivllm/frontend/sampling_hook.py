"""The one seam through which what nano-vllm's sampler lacks reaches the core (the interface, written here beside
its implementation so that the core imports no extra): top-k / top-p / min-p, penalties,
logit bias, allowed tokens, bad words, min_tokens, seeds, logprobs, prompt logprobs and grammar masks. The
engine is given one hook object at construction (sampling_extras.py implements it, LLM and the serving engine
core pass it); engine/llm_engine.py and engine/model_runner.py call it at lines marked `# sampling hook`.

Without a hook, or in a step where no row asks for an extra (`prepare` returns None), the engine samples as
nano-vllm does: temperatures only, drawn inside the decode CUDA graph on one GPU."""

from typing import Any, Protocol

import torch

from minivllm.engine.request import EngineOutput
from minivllm.engine.sequence import Sequence


class SamplingHook(Protocol):
    # --- the engine (llm_engine.py) ---

    def add_request(self, request_id: str, seqs: list[Sequence]) -> bool:
        """A request's sequences are about to be queued. True: they wait out of the scheduler until `ready` names
        the request (a grammar compiling in a thread)."""

    def ready(self, wait: float = 0.0) -> list[tuple[str, Exception | None]]:
        """(request id, None) of the waiting requests that may be scheduled now, (request id, error) of those that
        cannot run; waits up to `wait` seconds for one."""

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the hook (not yet in the scheduler)."""

    def shutdown(self) -> None:
        """The engine exits: drop what is still being prepared."""

    def failing_requests(self, seqs: list[Sequence], prepare_inputs, buffers, device) -> dict[str, Exception]:
        """A step failed to launch: request id -> the error of each request whose sequences fail alone (each one's
        step inputs, `prepare_inputs([seq])`, and sampling inputs prepared as a batch of one)."""

    def prompt_logprobs_outputs(self, seqs: list[Sequence], plan: Any, scored: Any) -> list[EngineOutput]:
        """A prefill step's prompt log-probabilities (`seqs`: its batch): an output with no token per sequence
        still running that asked, carrying its chunk's rows (`EngineOutput.prompt_logprobs`)."""

    def needs_history(self, seqs: list[Sequence]) -> bool:
        """A sequence of a launched step reads every previous token (penalties, bad words, a grammar): the engine
        reads that step's tokens back before it launches the next."""

    def advance(self, sampled: list[tuple[Sequence, int]], finish) -> list[Sequence]:
        """A step's tokens arrived (`sampled`: sequence, position): let each sequence's extras take its token;
        `finish(seq, reason)` ends one that must stop (a grammar that terminated). Returns those it ended."""

    # --- the model runner (model_runner.py, rank 0) ---

    def prepare(self, seqs: list[Sequence], buffers, *, device: torch.device, in_graph: bool) -> Any | None:
        """The step's sampling inputs on the device, or None when no row needs more than its temperature (the
        runner then samples as nano-vllm does). `in_graph`: the decode graph may draw the tokens."""

    def is_plain(self, batch: Any) -> bool:
        """True when `batch` holds temperatures only, so the decode graph's draw stands."""

    def sample(self, sampler, logits: torch.Tensor, batch: Any) -> tuple[torch.Tensor, Any | None]:
        """Tokens (B,) int64 from logits (B, V) with the extras applied, and the rows' raw logprobs (or None)."""

    def plan_prompt_logprobs(self, seqs: list[Sequence]) -> Any | None:
        """What a prefill step scores for prompt logprobs (None: no row asks; the hidden states are not kept)."""

    def score_prompt_logprobs(self, lm_head, hidden: torch.Tensor, plan: Any) -> Any:
        """The planned prompt positions scored from the step's hidden states (T, hidden)."""
