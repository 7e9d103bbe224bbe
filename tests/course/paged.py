"""A paged KV cache with shuffled block tables, and attention computed in fp64 on the contiguous keys: the truth
that chapters 06-08 compare with."""

from dataclasses import dataclass

import torch

from helpers.course import odd_size


@dataclass
class Paged:
    k_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (S, M) int32, -1 padded
    lens: list[int]  # keys per sequence

    def keys(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's keys and values, contiguous: 2 x (lens[i], Hkv, D)."""
        bs = self.k_cache.shape[1]
        slots = [int(self.block_tables[i, t // bs]) * bs + t % bs for t in range(self.lens[i])]
        return self.k_cache.flatten(0, 1)[slots], self.v_cache.flatten(0, 1)[slots]


def make_paged(
    gen,
    lens: list[int],
    heads_kv: int,
    head_dim: int,
    dtype,
    block_size: int = 5,
    spare: int = 3,
    scale_values: float = 1.0,
) -> Paged:
    need = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(need) + spare
    order = torch.randperm(num_blocks, generator=gen).tolist()  # blocks of a sequence are scattered
    tables = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    shape = (num_blocks, block_size, heads_kv, head_dim)
    k = (torch.randn(shape, generator=gen) * scale_values).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return Paged(k, v, tables, lens)


def masked_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dtype) -> tuple[torch.Tensor, ...]:
    """In `dtype`: the scores (H, Lq, Lk), causal bottom-right (query i sits at Lk - Lq + i, the rest -inf), and the
    values (Lk, H, D), their KV heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    k, v = k.to(dtype).repeat_interleave(group, 1), v.to(dtype).repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.to(dtype), k) * scale
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    return s.masked_fill(~mask, float("-inf")), v


def attention_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (Lq, H, D), k/v (Lk, Hkv, D), causal bottom-right (query i sits at Lk - Lq + i), GQA -> (Lq, H, D) fp64."""
    s, v = masked_scores(q, k, v, scale, torch.float64)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def attention_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The same in fp32 then cast to q's dtype: the reference's own rounding."""
    return attention_exact(q.float(), k.float(), v.float(), scale).float().to(q.dtype)


def sizes(gen) -> tuple[int, int, int]:
    """(Hkv, group, head_dim): GQA and sizes that are not powers of two."""
    return 3, 2, 2 * odd_size(gen, 5, 14)


def attention_bf16_probs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The same as a bf16 GPU kernel computes it (FlashAttention's trade, and our paged decode's on a GPU): scores,
    maxima and sums in fp32, the probabilities rounded to bf16 before they weight the values, one cast at the end."""
    s, v = masked_scores(q, k, v, scale, torch.float32)
    p = (s - s.amax(-1, keepdim=True)).exp()  # (H, Lq, Lk)
    out = torch.einsum("hqk,khd->qhd", p.to(torch.bfloat16).float(), v) / p.sum(-1).transpose(0, 1)[..., None]
    return out.to(q.dtype)
