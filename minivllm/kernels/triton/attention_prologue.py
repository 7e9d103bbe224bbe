"""The attention prologue in one Triton kernel (GPU path): everything between the QKV projection and the
attention kernel. Per token it splits the fused qkv row into heads, applies Qwen3's per-head RMSNorm to q
and k (notebook 01), rotates both with RoPE (notebook 02) and writes k and v into their slot of the paged
cache (notebook 06). Eagerly these are four to five kernels per layer (q-norm, k-norm, RoPE,
store_kvcache); in a decode step each is a few microseconds of launch for a few kilobytes of work, so
fusing them saves ~100 launches per step on a 28-layer model.

The Attention layer calls it (`Attention.forward_fused`) when the engine's kernel table has it, so the layer
owns the cache write on both paths. The CPU path (and notebooks 01, 02, 06) runs the same steps as separate
torch ops; notebook 18 checks this kernel against them through the Triton interpreter."""

import torch
import triton
import triton.language as tl

from minivllm.kernels.triton.paged_decode import pdl_args, pdl_launch_dependents, pdl_wait


@triton.jit
def _norm_rope(
    row_ptr,
    out_ptr,
    w_ptr,
    cos,
    sin,
    eps,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Heads [0, NUM_HEADS) of one token: RMSNorm over head_dim (optional), then RoPE. Returns the result
    as two (BLOCK_H, BLOCK_HALF) halves in the input dtype."""
    h = tl.arange(0, BLOCK_H)[:, None]  # (BLOCK_H, 1)
    d = tl.arange(0, BLOCK_HALF)[None, :]  # (1, BLOCK_HALF)
    mask = (h < NUM_HEADS) & (d < HALF)
    offs = h * (2 * HALF) + d  # first half of each head
    x1 = tl.load(row_ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(row_ptr + offs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:  # as rms_norm: fp32, cast, then weight
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)  # (BLOCK_H,)
        r = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        x1 = ((x1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * r).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(dtype)  # neox style: pair d with d + HALF
    y2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(out_ptr + offs, y1, mask=mask)
    tl.store(out_ptr + offs + HALF, y2, mask=mask)
    return y1, y2, offs, mask


@triton.jit
def attention_prologue_kernel(
    qkv_ptr,
    qkv_stride,
    positions_ptr,
    cos_sin_ptr,
    q_w_ptr,
    k_w_ptr,
    eps,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # programmatic dependent launch (kernels/triton/paged_decode.py)
        pdl_wait()
    n = tl.program_id(0).to(tl.int64)  # one program per token
    D: tl.constexpr = 2 * HALF
    row = qkv_ptr + n * qkv_stride  # [q heads | k heads | v heads]
    pos = tl.load(positions_ptr + n).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * D + d, mask=d < HALF, other=0.0)  # cache row: [cos | sin], fp32
    sin = tl.load(cos_sin_ptr + pos * D + HALF + d, mask=d < HALF, other=0.0)
    _norm_rope(
        row, q_out_ptr + n * NUM_HEADS * D, q_w_ptr, cos, sin, eps, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF, HAS_NORM
    )
    k1, k2, offs, mask = _norm_rope(
        row + NUM_HEADS * D,
        k_out_ptr + n * NUM_KV_HEADS * D,
        k_w_ptr,
        cos,
        sin,
        eps,
        NUM_KV_HEADS,
        HALF,
        BLOCK_KV,
        BLOCK_HALF,
        HAS_NORM,
    )
    if PDL:
        pdl_launch_dependents()
    if STORE:
        slot = tl.load(slot_mapping_ptr + n).to(tl.int64)
        if slot != -1:  # -1: padding, write nothing
            base = slot * NUM_KV_HEADS * D  # cache slot: (kv_heads, head_dim)
            tl.store(k_cache_ptr + base + offs, k1, mask=mask)
            tl.store(k_cache_ptr + base + offs + HALF, k2, mask=mask)
            v_row = row + (NUM_HEADS + NUM_KV_HEADS) * D
            tl.store(v_cache_ptr + base + offs, tl.load(v_row + offs, mask=mask), mask=mask)
            tl.store(v_cache_ptr + base + offs + HALF, tl.load(v_row + offs + HALF, mask=mask), mask=mask)


def attention_prologue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    use_pdl: bool = True,
):
    """qkv (N, (H + 2 Hkv) * D) from the QKV projection, positions (N,), cos_sin_cache (max_pos, 1, D) fp32
    ([cos | sin]), q/k_weight (D,) or None (no QK-norm: Qwen2, Llama), caches (num_blocks, block_size, Hkv, D)
    or empty (nothing stored, e.g. warm-up), slot_mapping (N,) with -1 = skip.
    use_pdl: programmatic dependent launch where the GPU has it (`pdl_args`, kernels/triton/paged_decode.py).
    Returns q (N, H, D) and k (N, Hkv, D), normed and rotated, and v (N, Hkv, D), a view of qkv."""
    N = qkv.shape[0]
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    assert qkv.shape[1] == (H + 2 * Hkv) * D and qkv.stride(1) == 1, f"qkv shape {tuple(qkv.shape)}"
    assert D % 2 == 0 and cos_sin_cache.shape[-1] == D and cos_sin_cache.is_contiguous()
    q = torch.empty(N, H, D, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(N, Hkv, D, dtype=qkv.dtype, device=qkv.device)
    v = qkv[:, (H + Hkv) * D :].view(N, Hkv, D)
    store = k_cache.numel() > 0 and v_cache.numel() > 0
    if store:
        assert k_cache.shape[2:] == (Hkv, D) and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert slot_mapping is not None and slot_mapping.numel() == N
    if N == 0:
        return q, k, v
    has_norm = q_weight is not None
    attention_prologue_kernel[(N,)](
        qkv,
        qkv.stride(0),
        positions,
        cos_sin_cache,
        q_weight if has_norm else qkv,
        k_weight if has_norm else qkv,
        eps,
        q,
        k,
        k_cache if store else qkv,
        v_cache if store else qkv,
        slot_mapping if store else positions,
        NUM_HEADS=H,
        NUM_KV_HEADS=Hkv,
        HALF=D // 2,
        BLOCK_H=triton.next_power_of_2(H),
        BLOCK_KV=triton.next_power_of_2(Hkv),
        BLOCK_HALF=triton.next_power_of_2(D // 2),
        HAS_NORM=has_norm,
        STORE=store,
        **pdl_args(qkv.device, use_pdl),
    )
    return q, k, v
