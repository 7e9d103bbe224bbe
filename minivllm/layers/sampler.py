"""The sampler (notebook 09): temperature sampling as an exponential race, argmax(p / E) with
E ~ Exp(1), which draws from p exactly. Beyond nano-vllm: temperature 0 is greedy, and per-sequence
top-k, top-p and min-p, all batched with no Python loop over sequences; a seeded request draws its noise
from its own generator (a loop over those rows only, as vLLM does), so its tokens do not depend on the
rest of the batch.

On a GPU the race runs as one Triton kernel in log space (Gumbel-max: argmax(l / T - log E), the same
draw without a softmax), reading each logits row once and drawing its noise in registers from a seed that
lives on the device, so a CUDA graph can replay it step after step with fresh noise."""

import torch
import triton
import triton.language as tl
from torch import nn

from minivllm.utils.switches import triton_runs_on


def check_sampling_tensors(
    logits: torch.Tensor, temperatures: torch.Tensor | None, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"Sampler: logits must be (num_seqs, vocab), got shape {tuple(logits.shape)}")
    for name, t in (("temperatures", temperatures), ("top_ks", top_ks), ("top_ps", top_ps)):
        if t is not None and tuple(t.shape) != (logits.shape[0],):
            raise ValueError(f"Sampler: {name} must have shape ({logits.shape[0]},), got {tuple(t.shape)}")


# not compiled: the sort dominates, and torch 2.11's inductor failed to generate the cumsum once the vocabulary
# dimension became dynamic (a second model in one process; benchmarks/RESULTS.md)
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


def exponential_race(
    logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    greedy = logits.argmax(dim=-1)  # (B,)
    t = torch.where(temperatures > 0, temperatures, 1.0)
    probs = torch.softmax(logits / t[:, None], dim=-1)  # (B, V)
    noise = torch.empty_like(probs).exponential_(1, generator=generator).clamp_min_(1e-10)  # E ~ Exp(1)
    sampled = (probs / noise).argmax(dim=-1)  # argmax(p / E) ~ p
    return torch.where(temperatures > 0, sampled, greedy)


def seeded_draw(logits_row: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One row's race with noise from its own generator (on the row's device): the draw depends only on this
    row's logits and the generator's state. temperature: a 0-d tensor > 0 (no host sync)."""
    probs = torch.softmax(logits_row.float() / temperature, dim=-1)  # (V,)
    noise = torch.empty_like(probs).exponential_(1, generator=generator).clamp_min_(1e-10)
    return (probs / noise).argmax()


# --- the race as one Triton kernel (GPU) ------------------------------------------------------------


@triton.jit
def _fold(row_ptr, cols, end, u, t, best, best_col):
    """Fold columns `cols` (BLOCK,) of one row into the per-lane running best score and its column."""
    logit = tl.load(row_ptr + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
    e = tl.maximum(-tl.log(u), 5.96e-8)  # E ~ Exp(1); u may round to 1.0 in fp32
    score = tl.where(t > 0, logit / t - tl.log(e), logit)  # l / T - log E, or l when greedy
    better = score > best  # strict: a lane keeps its earlier column on ties
    return tl.where(better, score, best), tl.where(better, cols, best_col)


@triton.jit
def gumbel_argmax_kernel(
    logits_ptr, stride, temps_ptr, seed_ptr, best_ptr, best_idx_ptr, V, CHUNK, BLOCK: tl.constexpr
):
    """Program (row, split) scans columns [split * CHUNK, (split + 1) * CHUNK) of one logits row, 4 * BLOCK
    at a time, and writes its best score and column. Each lane keeps its own running best (no reduction
    inside the loop); the lanes are reduced once at the end."""
    row, split = tl.program_id(0), tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    t = tl.load(temps_ptr + row)
    seed = tl.load(seed_ptr)
    offs = tl.arange(0, BLOCK)
    start = split * CHUNK  # CHUNK is a multiple of 4 * BLOCK
    end = tl.minimum(start + CHUNK, V)
    best = tl.full((BLOCK,), -float("inf"), tl.float32)  # (BLOCK,) per lane
    best_col = start + offs
    for c in range(start, end, 4 * BLOCK):
        # one Philox call gives 4 uniforms per counter; counters row * V/4 + c/4 + offs are never reused
        u0, u1, u2, u3 = tl.rand4x(seed, row * ((V + 3) // 4) + c // 4 + offs)
        best, best_col = _fold(row_ptr, c + offs, end, u0, t, best, best_col)
        best, best_col = _fold(row_ptr, c + BLOCK + offs, end, u1, t, best, best_col)
        best, best_col = _fold(row_ptr, c + 2 * BLOCK + offs, end, u2, t, best, best_col)
        best, best_col = _fold(row_ptr, c + 3 * BLOCK + offs, end, u3, t, best, best_col)
    m = tl.max(best, axis=0)
    col = tl.min(tl.where(best == m, best_col, V), axis=0)  # the first column of the max (torch.argmax's ties)
    tl.store(best_ptr + row * tl.num_programs(1) + split, m)
    tl.store(best_idx_ptr + row * tl.num_programs(1) + split, col)


@triton.jit(do_not_specialize=["num_splits"])  # one compiled kernel whatever the batch's split count
def gumbel_reduce_kernel(best_ptr, best_idx_ptr, out_ptr, seed_ptr, num_splits, BLOCK_S: tl.constexpr):
    """One program per row: the best of its splits is the token. Program 0 advances the seed, so the next
    launch (or graph replay) draws new noise; the sampling kernel has finished reading it by now."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)  # BLOCK_S: a power of 2 >= num_splits, fixed per vocabulary size
    best = tl.load(best_ptr + row * num_splits + offs, mask=offs < num_splits, other=-float("inf"))
    idx = tl.load(best_idx_ptr + row * num_splits + offs, mask=offs < num_splits, other=0)
    s = tl.argmax(best, axis=0)  # first split of the max: earlier columns win ties
    tl.store(out_ptr + row, tl.sum(tl.where(offs == s, idx, 0), axis=0).to(tl.int64))
    if row == 0:
        tl.store(seed_ptr, tl.load(seed_ptr) + 1)


def gumbel_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seed: torch.Tensor,
    out: torch.Tensor | None = None,
    block: int = 1024,
    splits: int | None = None,
) -> torch.Tensor:
    """The exponential race in one pass over `logits` (B, V) (any float dtype, rows contiguous) with
    temperatures (B,) (0 = greedy) and a 1-element int64 `seed` tensor that is advanced by one. Returns
    (B,) int64 token ids (into `out` when given). Rows are split so that small batches still fill the GPU;
    the draw does not depend on the split (each column's noise depends only on seed, row and column)."""
    B, V = logits.shape
    assert logits.stride(1) == 1 and temperatures.shape == (B,) and seed.numel() == 1
    out = out if out is not None else torch.empty(B, dtype=torch.int64, device=logits.device)
    step = 4 * block
    splits = splits or max(1, min(triton.cdiv(264, B), triton.cdiv(V, step)))  # ~2 programs per SM of an H200
    chunk = triton.cdiv(triton.cdiv(V, splits), step) * step
    splits = triton.cdiv(V, chunk)
    best = torch.empty(B, splits, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(B, splits, dtype=torch.int32, device=logits.device)
    gumbel_argmax_kernel[(B, splits)](
        logits, logits.stride(0), temperatures, seed, best, best_idx, V, chunk, BLOCK=block
    )
    most = triton.cdiv(V, step)  # the most splits any batch gets for this vocabulary
    block_s = triton.next_power_of_2(max(splits, most))
    gumbel_reduce_kernel[(B,)](best, best_idx, out, seed, splits, BLOCK_S=block_s)
    return out


class Sampler(nn.Module):
    """The engine's sampler. Its randomness is its own (not torch's global generator), so two engines in one
    process do not shift each other's draws: a device-side seed for the Triton race (GPU), a generator for
    the torch race (CPU)."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        super().__init__()
        seed_tensor = torch.tensor([seed], dtype=torch.int64, device=device)
        self.register_buffer("seed", seed_tensor, persistent=False)  # the kernel's
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def reset(self, seed: int) -> None:
        """Start the random streams again from `seed` (after warm-up and capture drew noise)."""
        self.seed.fill_(seed)
        self.generator.manual_seed(seed)

    def forward(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor | None,
        top_ks: torch.Tensor | None = None,
        top_ps: torch.Tensor | None = None,
        min_ps: torch.Tensor | None = None,
        generators: dict[int, torch.Generator] | None = None,
    ) -> torch.Tensor:
        """logits (B, V), temperatures (B,) float (0 = greedy), top_ks (B,) int (0 = off), top_ps (B,)
        float in (0, 1] (1 = off), min_ps (B,) float in [0, 1] (0 = off). The filters may be None when no row
        uses them (skips the sort); temperatures None when every row is greedy (skips the noise: the filters
        cannot change an argmax). generators: row -> that row's own generator (sampled rows only).
        Returns (B,) int64 token ids."""
        check_sampling_tensors(logits, temperatures, top_ks, top_ps)
        if temperatures is None:  # in fp32 as vLLM's sampler: on CPU a bf16 argmax is ~5x slower than cast + argmax
            return logits.float().argmax(dim=-1)
        if top_ks is not None or top_ps is not None or min_ps is not None:
            logits = logits.float()
            b = logits.shape[0]
            top_ks = top_ks if top_ks is not None else torch.zeros(b, dtype=torch.long, device=logits.device)
            top_ps = top_ps if top_ps is not None else torch.ones(b, device=logits.device)
            t = torch.where(temperatures > 0, temperatures, 1.0)  # (B,)
            # temperature first, then the filters (vLLM's and HF's order: the nucleus of softmax(logits / T))
            logits = filter_top_k_top_p(logits / t[:, None], top_ks, top_ps, min_ps)
            temperatures = (temperatures > 0).to(logits.dtype)  # already scaled; 0 stays greedy
        if triton_runs_on(logits):  # the kernel reads any float dtype as is
            tokens = self.race_kernel(logits, temperatures)
        else:
            tokens = exponential_race(logits.float(), temperatures, self.generator)
        for row, generator in (generators or {}).items():
            tokens[row] = seeded_draw(logits[row], temperatures[row], generator)
        return tokens

    def race_kernel(self, logits: torch.Tensor, temperatures: torch.Tensor, out: torch.Tensor | None = None):
        if self.seed.device != logits.device:
            self.seed = self.seed.to(logits.device)
        return gumbel_sample(logits, temperatures, self.seed, out)
