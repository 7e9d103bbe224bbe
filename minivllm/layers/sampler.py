"""The sampler (seed 000 section 9): temperature sampling as an exponential race, argmax(p / E) with
E ~ Exp(1), which draws from p exactly. Beyond nano-vllm: temperature 0 is greedy, and per-sequence
top-k and top-p, all batched with no Python loop over sequences."""
import torch
from torch import nn

from minivllm.utils.compile import compiled


def check_sampling_tensors(logits: torch.Tensor, temperatures: torch.Tensor | None,
                           top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"Sampler: logits must be (num_seqs, vocab), got shape {tuple(logits.shape)}")
    for name, t in (("temperatures", temperatures), ("top_ks", top_ks), ("top_ps", top_ps)):
        if t is not None and tuple(t.shape) != (logits.shape[0],):
            raise ValueError(f"Sampler: {name} must have shape ({logits.shape[0]},), got {tuple(t.shape)}")


# not compiled: the sort dominates, and torch 2.11's inductor failed to generate the cumsum once the vocabulary
# dimension became dynamic (a second model in one process; benchmarks/RESULTS.md)
def filter_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k (k = 0: all) and top-p nucleus (p = 1: all)."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)               # (B, V)
    k = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab)                    # (B,)
    ranks = torch.arange(vocab, device=logits.device)                              # (V,)
    drop = ranks[None, :] >= k[:, None]                                            # outside top-k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs                                     # mass of better tokens
    drop |= mass_before >= top_ps[:, None]                                         # nucleus: keep until p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


@compiled
def exponential_race(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    greedy = logits.argmax(dim=-1)                                                  # (B,)
    t = torch.where(temperatures > 0, temperatures, 1.0)
    probs = torch.softmax(logits / t[:, None], dim=-1)                              # (B, V)
    noise = torch.empty_like(probs).exponential_(1).clamp_min_(1e-10)              # E ~ Exp(1)
    sampled = (probs / noise).argmax(dim=-1)                                        # argmax(p / E) ~ p
    return torch.where(temperatures > 0, sampled, greedy)


class Sampler(nn.Module):

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor | None,
                top_ks: torch.Tensor | None = None, top_ps: torch.Tensor | None = None) -> torch.Tensor:
        """logits (B, V), temperatures (B,) float (0 = greedy), top_ks (B,) int (0 = off), top_ps (B,)
        float in (0, 1] (1 = off). top_ks / top_ps may be None when no row filters (skips the sort);
        temperatures None when every row is greedy (skips the noise: the filters cannot change an argmax).
        Returns (B,) int64 token ids."""
        check_sampling_tensors(logits, temperatures, top_ks, top_ps)
        if temperatures is None:
            return logits.argmax(dim=-1)
        logits = logits.float()
        if top_ks is not None or top_ps is not None:
            b = logits.shape[0]
            top_ks = top_ks if top_ks is not None else torch.zeros(b, dtype=torch.long, device=logits.device)
            top_ps = top_ps if top_ps is not None else torch.ones(b, device=logits.device)
            t = torch.where(temperatures > 0, temperatures, 1.0)                      # (B,)
            # temperature first, then the filters (vLLM's and HF's order: the nucleus of softmax(logits / T))
            logits = filter_top_k_top_p(logits / t[:, None], top_ks, top_ps)
            temperatures = (temperatures > 0).to(logits.dtype)                        # already scaled; 0 stays greedy
        return exponential_race(logits, temperatures)
