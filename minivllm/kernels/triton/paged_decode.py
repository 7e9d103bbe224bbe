"""Paged decode attention as one Triton kernel (ours; the GPU decode path with the flash backends).

One query per sequence reads that sequence's keys and values through its block table, with the online softmax of
notebook 07. One program per (sequence, KV head, split): the GROUP query heads that share a KV head (GQA) are handled
together, so each K/V tile is read from memory once. Small batches split the context (flash-decoding): each split
writes a partial result with its log-sum-exp and a second kernel combines them, so a few long sequences still keep
every SM busy. Not FlashAttention-4's decode: a fixed ~0.3 us per sequence and layer, and no split-KV on SM90."""

from functools import lru_cache

import torch
import triton
import triton.language as tl


# Not specialised on (Triton compiles a variant per integer equal to 1 or a multiple of 16): one kernel for split and
# one for unsplit launches, not one per split count, and a prefill step's decode rows run the decode graphs' kernel.
@triton.jit(do_not_specialize=["num_splits", "table_stride"])
def paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    lse_ptr,
    scale,
    table_stride,
    num_splits,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partial results and their log-sum-exp
    HEADS_FASTEST: tl.constexpr,  # grid (Hkv, B, splits) instead of (B, Hkv, splits): see paged_decode
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # programmatic dependent launch: the end of this file
        pdl_wait()
    if HEADS_FASTEST:
        kvh, b = tl.program_id(0), tl.program_id(1)
    else:
        b, kvh = tl.program_id(0), tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    g = tl.arange(0, BLOCK_G)  # query heads kvh * GROUP + g, g < GROUP
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    rows = b * NUM_KV_HEADS * GROUP + kvh * GROUP + g  # (BLOCK_G,) rows of q and out: sequence b's query heads
    row_mask = (g[:, None] < GROUP) & (d[None, :] < D)  # (BLOCK_G, BLOCK_D)
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=row_mask, other=0.0)  # (BLOCK_G, BLOCK_D)
    # this split's keys: [start, end), the context cut into num_splits parts of a multiple of BLOCK_N keys
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)
    m = tl.full((BLOCK_G,), -float("inf"), tl.float32)  # running max of the scores (base 2)
    l = tl.zeros((BLOCK_G,), tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)  # running sum of p * v
    qk_scale = scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + n  # (BLOCK_N,)
        valid = tok < end
        page = tl.load(block_tables_ptr + b * table_stride + tok // PAGE, mask=valid, other=0).to(tl.int64)
        row = (page * PAGE + tok % PAGE) * NUM_KV_HEADS + kvh  # cache row of (token, kvh)
        kv_offs = row[:, None] * D + d[None, :]  # (BLOCK_N, BLOCK_D)
        kv_mask = valid[:, None] & (d[None, :] < D)
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if IEEE:  # fp32 model, or the CPU interpreter
            s = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee")  # (BLOCK_G, BLOCK_N)
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * qk_scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)  # rescale what was summed under the old max
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if PDL:
        pdl_launch_dependents()
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # an empty split or context: zeros
    o_offs = (rows[:, None] * num_splits + split) * D + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    if SPLIT:  # log-sum-exp (base 2) of this split's scores
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), -float("inf"))
        tl.store(lse_ptr + rows * num_splits + split, lse, mask=g < GROUP)


@triton.jit(do_not_specialize=["num_splits"])
def combine_splits_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # a power of 2 >= num_splits
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (sequence, head): out = sum_s w_s * partial_s with w = softmax over splits of lse_s."""
    if PDL:
        pdl_wait()
    bh = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + bh * num_splits + s, mask=s < num_splits, other=-float("inf"))  # (BLOCK_S,)
    top = tl.max(lse, axis=0)
    w = tl.where(lse > -float("inf"), tl.exp2(lse - top), 0.0)
    w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)  # all splits empty (context 0): zeros
    part = tl.load(
        partial_ptr + (bh * num_splits + s[:, None]) * D + d[None, :],
        mask=(s[:, None] < num_splits) & (d[None, :] < D),
        other=0.0,
    ).to(tl.float32)  # (BLOCK_S, BLOCK_D)
    out = tl.sum(part * w[:, None], axis=0)
    if PDL:
        pdl_launch_dependents()
    tl.store(out_ptr + bh * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


MAX_SPLITS = 16
HEADS_FASTEST = True  # grid (Hkv, B, splits): 1-1.5% faster at batch 96-256 (benchmarks/sweep_paged_decode.py --grid)


def num_splits(batch: int, num_kv_heads: int, max_splits: int = MAX_SPLITS) -> int:
    """How many parts each context is cut into: a function of the batch only, so a CUDA graph captured for a batch
    size keeps it. Up to 768 (sequence, KV head) pairs, at least 4: a batch's contexts differ by up to 4x and the
    longest unsplit ones set the time (batch 64: 96.6 us unsplit, 88.9 in 4 parts); under 96 pairs more, for ~3
    programs per SM. Above 768, unsplit: splitting only adds the combine (benchmarks/sweep_paged_decode.py)."""
    pairs = batch * num_kv_heads
    return 1 if pairs > 768 else min(max_splits, max(4, triton.cdiv(384, pairs)))


def tile_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(BLOCK_N keys per tile, pipeline stages): 128 keys and 4 stages beat 64 and 3 by 4-6% at batch 128-256 and by
    a third at batch 16 (bf16, head_dim 128; benchmarks/sweep_paged_decode.py); wider rows (fp32) keep 64 and 3."""
    return (128, 4) if torch.finfo(dtype).bits * head_dim <= 16 * 128 else (64, 3)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    heads_fastest: bool = HEADS_FASTEST,
    use_pdl: bool = True,
) -> torch.Tensor:
    """q (B, H, D), caches (num_blocks, block_size, Hkv, D), context_lens (B,) int32, block_tables (B, M) int32 with
    valid block ids in every entry a context reaches -> (B, H, D). Tiles by `tile_config`; heads_fastest: programs
    side by side read the KV heads of the same tokens (one cache row), not one head of many sequences."""
    B, H, D = q.shape
    default_n, default_stages = tile_config(q.dtype, D)
    block_n, num_stages = block_n or default_n, num_stages or default_stages
    _, page, Hkv, _ = k_cache.shape
    assert H % Hkv == 0 and q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.stride(1) == 1 and block_tables.shape[0] == B and context_lens.shape == (B,)
    splits = splits or num_splits(B, Hkv)
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    partial = out if splits == 1 else torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device) if splits > 1 else partial
    group, pdl = H // Hkv, pdl_args(q.device, use_pdl)
    grid = (Hkv, B, splits) if heads_fastest else (B, Hkv, splits)
    args = (q, k_cache, v_cache, block_tables, context_lens, partial, lse, scale, block_tables.stride(0), splits)
    paged_decode_kernel[grid](
        *args,
        NUM_KV_HEADS=Hkv,
        GROUP=group,
        D=D,
        PAGE=page,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_N=block_n,
        SPLIT=splits > 1,
        HEADS_FASTEST=heads_fastest,
        IEEE=q.dtype == torch.float32 or not q.is_cuda,  # the interpreter's bf16 tl.dot is wrong: fp32 there
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl,
    )
    if splits > 1:
        block_s = max(MAX_SPLITS, triton.next_power_of_2(splits))  # one variant for the engine's splits
        combine_splits_kernel[(B * H,)](
            partial, lse, out, splits, D=D, BLOCK_S=block_s, BLOCK_D=triton.next_power_of_2(D), **pdl
        )
    return out


# --- programmatic dependent launch (PDL, Hopper and later) ----------------------------------------------------
# A decode step's CUDA graph runs ~270 kernels of a few microseconds each, each paying for its start and tail while
# the GPU is partly idle. With PDL a kernel may start while the one before it runs. Each of our decode-step kernels
# (these two and the attention prologue) calls `pdl_wait()` before it reads what an earlier kernel wrote or writes
# anything (it returns once the previous kernel has finished, its writes visible), and `pdl_launch_dependents()`
# after its main loop: the next kernel's programs launch while our last ones store (triggered at the start, whole
# chains would launch ahead and wait on the SMs). A decode step is ~10-30 us faster. Off on CPU and before Hopper.


@lru_cache(None)
def pdl_args(device: torch.device, wanted: bool = True) -> dict:
    """The PDL constexpr and launch argument of a kernel on `device`: on where asked for, on Hopper or later."""
    on = wanted and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


@triton.jit
def pdl_launch_dependents():
    tl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def pdl_wait():
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
