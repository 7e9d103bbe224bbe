"""Decode-batch matmuls as one Triton kernel (ours; GPU path of the linear layers, see linear.py).

In a decode step x has one row per running sequence (M = 1 to a few dozen), so y = x @ W.T is a
weight-streaming problem: the whole of W is read once, the arithmetic is small. cuBLAS tiles these shapes
with 64 output columns per thread block, so Qwen3-0.6B's q/k/v projection (4096 columns) runs on 64 of the
H200's 132 SMs and reads its weights at about a third of the copy bandwidth (benchmarks/NOTES.md). Here a
program owns BN output columns (16 to 64) for all M rows and streams its slice of W through K in BK-wide
tiles, so even the 1024-column projections start 64 programs and the wider ones fill every SM.

`silu_mul=True` is the MLP's gate/up projection with SwiGLU fused in: W holds the gate rows, then the up rows
(MergedColumnParallelLinear's layout); a program computes the same BN columns of both halves and writes
silu(gate) * up, so the (M, 2I) intermediate never goes to memory and SiluAndMul's kernel is gone. gate and
up are rounded to the model's dtype first, as the unfused path does."""
import os

import torch
import triton
import triton.language as tl

from minivllm.utils import pdl

# the largest batch that takes this kernel (cuBLAS above, and for prefill); 0 turns it off
MAX_M = int(os.environ.get("MINIVLLM_SKINNY_MAX_M", "64"))


def set_max_m(m: int) -> None:
    global MAX_M
    MAX_M = m


def decode_batch(x: torch.Tensor) -> bool:
    """A decode-sized batch on the GPU: (M <= MAX_M, features) rows."""
    return x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_M


def enabled(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The linear layers ask this: a decode batch and contiguous rows."""
    return decode_batch(x) and x.stride(1) == 1 and weight.stride(1) == 1


@triton.jit
def skinny_gemm_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y, UP,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SILU_MUL: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, LINE: tl.constexpr,
                       LINES: tl.constexpr):
    """Program (n, m): y[m * BM:(m + 1) * BM, n * BN:(n + 1) * BN] over all of K. With SILU_MUL the up
    rows of W start UP rows after the gate rows. With PDL (utils/pdl.py) the program first prefetches its
    rows of W into L2 (one address per LINE-element line, LINES of them), while the kernel before it ends."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)                                  # (BM,) rows of x and y
    rn = pid_n * BN + tl.arange(0, BN)                                  # (BN,) columns of y = rows of W
    if PDL:
        if PDL == 1:
            pdl.launch_dependents()
        line_k = tl.minimum(tl.arange(0, LINES) * LINE, K - 1)                      # (LINES,)
        w_rows = tl.minimum(rn, N - 1)[:, None].to(tl.int64) * stride_w
        pdl.prefetch_l2(w_ptr + w_rows + line_k[None, :])                           # (BN, LINES)
        if SILU_MUL:
            pdl.prefetch_l2(w_ptr + UP * stride_w + w_rows + line_k[None, :])
        pdl.wait()
    rk = tl.arange(0, BK)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :]            # (BM, BK)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :]            # (BN, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    acc_up = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + rk) < K
        x = tl.load(x_ptrs, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=(rn[:, None] < N) & k_ok[None, :], other=0.0)
        if IEEE:                                        # fp32 model, or the CPU interpreter
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)                                      # (BM, BN)
        if SILU_MUL:
            w_up = tl.load(w_ptrs + UP * stride_w, mask=(rn[:, None] < N) & k_ok[None, :], other=0.0)
            if IEEE:
                acc_up = tl.dot(x.to(tl.float32), tl.trans(w_up.to(tl.float32)), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(x, tl.trans(w_up), acc_up)
        x_ptrs += BK
        w_ptrs += BK
    if PDL == 2:
        pdl.launch_dependents()
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out_ty = y_ptr.dtype.element_ty
    if SILU_MUL:
        gate = acc.to(out_ty).to(tl.float32)            # rounded like the unfused path's (M, 2I) output
        up = acc_up.to(out_ty).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up         # silu(gate) * up
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
    tl.store(y_ptrs, acc.to(out_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def default_config(M: int, N: int) -> tuple[int, int, int, int]:
    """(BN, BK, num_warps, num_stages): the widest BN that still gives >= 128 programs (16 at least)."""
    bn = next((b for b in (64, 32) if triton.cdiv(N, b) >= 128), 16)
    return bn, 128, 4, 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  silu_mul: bool = False, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T (+ bias) -> (M, N); with silu_mul, weight (2I, K) -> silu(gate) * up (M, I)."""
    M, K = x.shape
    N = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"skinny_linear: x has {K} features, weight {tuple(weight.shape)}")
    if silu_mul and (weight.shape[0] % 2 or bias is not None):
        raise ValueError("skinny_linear: silu_mul needs an even number of weight rows (gate, up) and no bias")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = config or default_config(M, N)
    bm = max(16, triton.next_power_of_2(min(M, 64)))
    bk = min(bk, max(16, triton.next_power_of_2(K)))
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm))
    skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else x, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0), N,
        BM=bm, BN=bn, BK=bk, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        IEEE=x.dtype == torch.float32 or not x.is_cuda,    # the interpreter's bf16 tl.dot is wrong: fp32 there
        PDL=pdl.mode(x), LINE=128 // weight.element_size(), LINES=triton.next_power_of_2(triton.cdiv(K, 128 // weight.element_size())),
        num_warps=warps, num_stages=stages, **pdl.launch_kwargs(x))
    return y
