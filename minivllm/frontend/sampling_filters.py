"""What a request's sampling adds to the core's Sampler (layers/sampler.py: temperature and the draw): per-row
top-k, top-p and min-p, all batched with no Python loop over sequences, and seeded rows that draw their noise from
their own generator (a loop over those rows only, as vLLM does), so their tokens do not depend on the rest of the
batch. The sampling hook's `sample` calls `sample` here (sampling_inputs.py: `sample_tokens`); notebook 09 builds
the filters."""

import torch

from minivllm.layers.sampler import Sampler


def check_sampling_tensors(
    logits: torch.Tensor, temperatures: torch.Tensor | None, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"Sampler: logits must be (num_seqs, vocab), got shape {tuple(logits.shape)}")
    for name, t in (("temperatures", temperatures), ("top_ks", top_ks), ("top_ps", top_ps)):
        if t is not None and tuple(t.shape) != (logits.shape[0],):
            raise ValueError(f"Sampler: {name} must have shape ({logits.shape[0]},), got {tuple(t.shape)}")


# not compiled: the sort dominates, and inductor cannot generate the cumsum once the vocabulary dimension is
# dynamic (a second model in one process; benchmarks/HISTORY.md)
def filter_top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor | None = None
) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k (k = 0: all) and top-p nucleus (p = 1: all), and, with
    min_ps, below min_p x the row's largest probability (first, as vLLM: the nucleus is of what is left)."""
    vocab = logits.shape[-1]
    if min_ps is not None:
        probs = logits.softmax(dim=-1)  # (B, V)
        logits = logits.masked_fill(probs < min_ps[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # (B, V)
    k = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab)  # (B,)
    ranks = torch.arange(vocab, device=logits.device)  # (V,)
    drop = ranks[None, :] >= k[:, None]  # outside top-k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of better tokens
    drop |= mass_before >= top_ps[:, None]  # nucleus: keep until p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def seeded_draw(logits_row: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One row's race with noise from its own generator (on the row's device): the draw depends only on this
    row's logits and the generator's state. temperature: a 0-d tensor > 0 (no host sync)."""
    probs = torch.softmax(logits_row.float() / temperature, dim=-1)  # (V,)
    noise = torch.empty_like(probs).exponential_(1, generator=generator).clamp_min_(1e-10)
    return (probs / noise).argmax()


def sample(
    sampler: Sampler,
    logits: torch.Tensor,
    temperatures: torch.Tensor | None,
    top_ks: torch.Tensor | None = None,
    top_ps: torch.Tensor | None = None,
    min_ps: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> torch.Tensor:
    """logits (B, V), temperatures (B,) float (0 = greedy), top_ks (B,) int (0 = off), top_ps (B,) float in (0, 1]
    (1 = off), min_ps (B,) float in [0, 1] (0 = off). The filters may be None when no row uses them (skips the
    sort); temperatures None when every row is greedy (the filters cannot change an argmax). generators: row ->
    that row's own generator (sampled rows only). Returns (B,) int64 token ids, drawn by `sampler`."""
    check_sampling_tensors(logits, temperatures, top_ks, top_ps)
    if temperatures is not None and (top_ks is not None or top_ps is not None or min_ps is not None):
        logits = logits.float()
        b = logits.shape[0]
        top_ks = top_ks if top_ks is not None else torch.zeros(b, dtype=torch.long, device=logits.device)
        top_ps = top_ps if top_ps is not None else torch.ones(b, device=logits.device)
        t = torch.where(temperatures > 0, temperatures, 1.0)  # (B,)
        # temperature first, then the filters (vLLM's and HF's order: the nucleus of softmax(logits / T))
        logits = filter_top_k_top_p(logits / t[:, None], top_ks, top_ps, min_ps)
        temperatures = (temperatures > 0).to(logits.dtype)  # already scaled; 0 stays greedy
    tokens = sampler(logits, temperatures)  # (B,)
    for row, generator in (generators or {}).items():
        tokens[row] = seeded_draw(logits[row], temperatures[row], generator)
    return tokens
