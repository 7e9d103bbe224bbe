"""Attention over the paged KV cache in plain torch: what a CPU runs, and the reference the FlashAttention backends
are checked against. FlashAttention's inputs and layout: caches (num_blocks, block_size, num_kv_heads, head_dim),
block tables (num_seqs, max_blocks) int32 padded with -1, causal masks aligned bottom-right (the last query sees every
key), GQA by head groups."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None = None, causal: bool = False) -> Tensor:
    # q: (B, Lq, H, D), k/v: (B, Lk, Hkv, D) -> (B, Lq, H, D); mask: (B or 1, 1, Lq, Lk) bool, True = may attend
    dtype = q.dtype
    if q.device.type == "cpu" and dtype != torch.float32:  # CPU SDPA in bf16 is ~4x slower than in fp32
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, L, D)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return o.transpose(1, 2).to(dtype)


def capturing() -> bool:
    """A CUDA graph is being captured on this stream: no host sync (no value read back, no data-dependent shape)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def causal_mask(q_len: int, k_len: int, device=None) -> Tensor:
    """(q_len, k_len) bool, True = may attend: query i sits at absolute position k_len - q_len + i."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(k_len, device=device)[None, :]
    return j <= i + (k_len - q_len)


def gather_paged(cache: Tensor, block_table: Tensor, length: int) -> Tensor:
    """The first `length` tokens of one sequence: (length, num_kv_heads, head_dim)."""
    block_size = cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size].long()
    return cache[blocks].flatten(0, 1)[:length]


def check_heads(q: Tensor, k: Tensor) -> None:
    if q.dim() != 3 or q.shape[-1] != k.shape[-1] or q.shape[-2] % k.shape[-2] != 0:
        want = f"(tokens, heads, head_dim) with the head_dim of k {tuple(k.shape)}"
        raise ValueError(f"q {tuple(q.shape)} must be {want} and a multiple of its {k.shape[-2]} kv heads")


def check_paged_shapes(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, context_lens: Tensor, block_tables: Tensor, decode: bool = False
) -> None:
    """The shapes of a paged call (no tensor op, no host sync); `decode`: one query per sequence."""
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        caches = f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}"
        raise ValueError(f"{caches} must both be (num_blocks, block_size, kv_heads, head_dim)")
    check_heads(q, k_cache)
    if block_tables.dim() != 2 or block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} must be (num_seqs={context_lens.shape[0]}, max_blocks)"
        )
    if decode and q.shape[0] != context_lens.shape[0]:
        raise ValueError(f"{q.shape[0]} queries but {context_lens.shape[0]} context lengths (one query per sequence)")


def check_tables(context_lens: Tensor, block_tables: Tensor, num_blocks: int, block_size: int) -> None:
    """Every context fits its table, and every block it uses is in the cache (host syncs)."""
    max_len = int(context_lens.max()) if context_lens.numel() else 0
    if max_len > block_tables.shape[1] * block_size:
        covered = f"{block_tables.shape[1]} blocks x {block_size}"
        raise ValueError(f"a context of {max_len} tokens is longer than the block table covers ({covered})")
    entries = torch.arange(block_tables.shape[1], device=block_tables.device)  # (M,)
    needed = (context_lens[:, None].long() + block_size - 1) // block_size > entries  # (S, M) the entries in use
    used = block_tables[needed]
    if used.numel() and (int(used.max()) >= num_blocks or int(used.min()) < 0):
        raise ValueError(
            f"block table points outside the cache: blocks {int(used.min())}..{int(used.max())}, cache has {num_blocks}"
        )


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """Prefill over fresh K/V: q (Nq, H, D), k/v (Nq, Hkv, D) packed by cu_seqlens -> (Nq, H, D)."""
    if not (q.shape[0] == k.shape[0] == v.shape[0] == int(cu_seqlens[-1])):
        raise ValueError(
            f"q/k/v token counts {q.shape[0]}/{k.shape[0]}/{v.shape[0]} != cu_seqlens[-1] = {int(cu_seqlens[-1])}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    check_heads(q, k)
    o = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        o[start:end] = _sdpa(q[None, start:end], k[None, start:end], v[None, start:end], scale, causal=True)[0]
    return o


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    block_tables: Tensor,
    scale: float,
) -> Tensor:
    """Prefill whose keys are in the cache (prefix hit, later chunk): sequence i has
    cu_seqlens_q[i+1] - cu_seqlens_q[i] new queries and context_lens[i] keys (new ones included)."""
    check_paged_shapes(q, k_cache, v_cache, context_lens, block_tables)
    check_tables(context_lens, block_tables, *k_cache.shape[:2])  # host syncs: a prefill is never graph-captured
    if cu_seqlens_q.numel() != context_lens.numel() + 1 or q.shape[0] != int(cu_seqlens_q[-1]):
        raise ValueError(
            f"cu_seqlens_q {cu_seqlens_q.tolist()} must have one entry more than context_lens "
            f"({context_lens.numel()} sequences) and end at the {q.shape[0]} query tokens"
        )
    o = torch.empty_like(q)
    bounds, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end - start > lens[i]:
            raise ValueError(f"sequence {i}: {end - start} queries but only {lens[i]} keys in its context")
        k = gather_paged(k_cache, block_tables[i], lens[i])
        v = gather_paged(v_cache, block_tables[i], lens[i])
        mask = causal_mask(end - start, lens[i], q.device)
        o[start:end] = _sdpa(q[None, start:end], k[None], v[None], scale, mask=mask)[0]
    return o


@dataclass(slots=True)
class DecodeGather:
    """The cache rows decode attention reads and which of them each sequence may see: the same for every layer of
    a step, so the first layer builds it and the others find it in their backend's `cache` (two torch.equal, ~1 us,
    instead of ~15 small ops, ~45 us on CPU: SmolLM2's CPU engine decodes ~10% faster in bf16, ~5% in fp32)."""

    context_lens: Tensor  # (B,) int32, the values it was built from (a copy, on CPU)
    block_tables: Tensor  # (B, M) int32, likewise
    cache_blocks: tuple[int, int]  # (num_blocks, block_size) of the cache it was checked against
    slots: Tensor  # (B, L) int64, the cache row of key j of sequence b
    mask: Tensor  # (B, 1, 1, L) bool, True = key j is in sequence b's context

    def fits(self, context_lens: Tensor, block_tables: Tensor, cache_blocks: tuple[int, int]) -> bool:
        same = self.cache_blocks == cache_blocks and torch.equal(self.context_lens, context_lens)
        return same and torch.equal(self.block_tables, block_tables)


def decode_gather(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, context_lens: Tensor, block_tables: Tensor, cache: dict | None = None
) -> DecodeGather:
    """The rows to gather: the last ones built (in `cache`) if their inputs are equal (CPU only: a GPU would sync to
    compare, and a CUDA graph cannot), else new ones. Shapes checked each call."""
    check_paged_shapes(q, k_cache, v_cache, context_lens, block_tables, decode=True)
    cache_blocks = (num_blocks, block_size) = tuple(k_cache.shape[:2])
    cpu = q.device.type == "cpu" and cache is not None
    last = cache.get("gather") if cpu else None
    if last is not None and last.fits(context_lens, block_tables, cache_blocks):
        return last
    width = block_tables.shape[1] * block_size  # keys the tables can reach: no host sync (a CUDA graph may hold this)
    if not capturing():
        check_tables(context_lens, block_tables, num_blocks, block_size)
        width = min(width, max(1, int(context_lens.max())))  # only the keys some sequence has (CPU: 5-10x less copying)
    pos = torch.arange(width, device=q.device)  # (L,)
    tables = block_tables.clamp(min=0).long()  # -1 padding -> any valid block
    slots = tables[:, pos // block_size] * block_size + pos % block_size  # (B, L) cache slot of key j
    mask = pos[None, :] < context_lens[:, None]  # (B, L)
    g = DecodeGather(context_lens, block_tables, cache_blocks, slots, mask[:, None, None, :])
    if cpu:
        g.context_lens, g.block_tables = context_lens.clone(), block_tables.clone()  # the values, for `fits`
        cache["gather"] = g
    return g


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    context_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    cache: dict | None = None,
) -> Tensor:
    """Decode, batched: q (B, H, D), one query per sequence over its context_lens[b] cached keys -> (B, H, D).
    `cache`: where the last gather is kept between calls (decode_gather), or None."""
    g = decode_gather(q, k_cache, v_cache, context_lens, block_tables, cache)
    rows, shape = g.slots.flatten(), (*g.slots.shape, *k_cache.shape[2:])  # (B * L,), (B, L, Hkv, D)
    # index_select copies whole rows (Hkv * D values each); advanced indexing `cache[slots]` went value by value
    k = k_cache.flatten(0, 1).index_select(0, rows).view(shape)  # (B, L, Hkv, D)
    v = v_cache.flatten(0, 1).index_select(0, rows).view(shape)
    return _sdpa(q[:, None], k, v, scale, mask=g.mask)[:, 0]  # (B, H, D)
