"""Log-probabilities a request asked for (`SamplingParams.logprobs`), vLLM's default kind: of the raw model
logits, before temperature, penalties and filters, so they describe the model, not the sampler. Per output
token: the k most likely tokens with their log-probabilities, and the sampled token's log-probability and
rank (1 = the most likely; tokens as likely as it count ahead of it, as vLLM counts)."""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LogprobsTensors:
    rows: list[int]  # the batch rows these are for
    top_ids: torch.Tensor  # (R, k) int64, most likely first
    top_logprobs: torch.Tensor  # (R, k) float32
    sampled_logprobs: torch.Tensor | None = None  # (R,) float32
    sampled_ranks: torch.Tensor | None = None  # (R,) int64

    def tolists(self) -> dict[int, tuple]:
        """Row -> (top ids, top logprobs, sampled logprob, sampled rank) as Python numbers (waits for them)."""
        cols = [t.tolist() for t in (self.top_ids, self.top_logprobs, self.sampled_logprobs, self.sampled_ranks)]
        return {row: tuple(c[i] for c in cols) for i, row in enumerate(self.rows)}


def raw_logprobs(logits: torch.Tensor, rows: list[int], k: int) -> tuple[torch.Tensor, LogprobsTensors]:
    """log_softmax of `logits[rows]` (R, V) float32, and its top k (k may be 0)."""
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits[index].float().log_softmax(dim=-1)  # (R, V)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # (R, k)
    return logprobs, LogprobsTensors(rows, top_ids, top_logprobs)


def add_sampled(out: LogprobsTensors, logprobs: torch.Tensor, tokens: torch.Tensor) -> LogprobsTensors:
    """Fill in the sampled tokens' log-probabilities and ranks; tokens (B,) int64 of the whole batch."""
    sampled = tokens[torch.tensor(out.rows, device=tokens.device)]  # (R,)
    chosen = logprobs.gather(1, sampled[:, None])  # (R, 1)
    out.sampled_logprobs = chosen[:, 0]
    out.sampled_ranks = (logprobs >= chosen).sum(dim=-1)  # rank 1 = most likely
    return out
