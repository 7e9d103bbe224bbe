"""A launched step (model_runner.py's `launch`): its sampled tokens on their way back to the host."""

import torch


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
