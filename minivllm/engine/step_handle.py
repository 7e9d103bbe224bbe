"""A launched step (model_runner.py's `launch`): its sampled tokens on their way back to the host, and what the
engine (llm_engine.py) keeps of it until they arrive."""

from dataclasses import dataclass

import torch

from minivllm.engine.sequence import Sequence


class StepHandle:
    """A launched step: `result()` waits for its sampled tokens (one per sequence) and returns them, with the
    log-probabilities of the rows that asked for them ({row: (top ids, top logprobs, logprob, rank)})."""

    def __init__(self, tokens: torch.Tensor, host: torch.Tensor | None, logprobs=None):
        # `tokens` may be a view of `last_sampled`, which the next step overwrites: take the values now
        self.n = tokens.shape[0]
        self.tokens, self.host, self.event = tokens if host is not None else tokens.clone(), host, None
        self.logprobs = logprobs  # the sampling hook's LogprobsTensors (frontend/logprobs.py), or None
        self.prompt_logprobs = None  # (plan, scored) of the rows that asked, from the sampling hook
        if host is not None:  # GPU: copy back without waiting (ordered before the next step's writes)
            host[: self.n].copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> tuple[list[int], dict[int, tuple]]:
        if self.event is None:
            tokens = self.tokens.tolist()
        else:
            self.event.synchronize()
            tokens = self.host[: self.n].tolist()
        return tokens, self.logprobs.tolists() if self.logprobs is not None else {}


@dataclass(slots=True)
class StepRecord:
    """Where one step's wall time went (host seconds; `run` includes the GPU work, which it waits for)."""

    is_prefill: bool
    num_seqs: int
    num_tokens: int
    schedule: float
    run: float
    postprocess: float


@dataclass(slots=True)
class Launched:
    """A step launched on the device whose tokens have not been read back yet."""

    seqs: list[Sequence]
    sampled: list[tuple[Sequence, int]]  # (sequence, position of its PENDING token)
    handle: StepHandle
    record: StepRecord
    needs_history: bool  # a request in it has penalties, bad words or a grammar: finish it before the next launch
