"""Are cuBLAS's kernels for a large decode batch's matmuls beaten by a plain Triton GEMM tuned per shape? (GPU)

At batch 128-256 a decode step's four matmuls per layer take ~30 us where their arithmetic alone would take
~6-11 us at the H200's matmul rate (benchmarks/NOTES.md part IX): tiles of 128 x 128 leave most SMs idle on
outputs of 1,024-6,144 columns. For each of Qwen3-0.6B's projections and batch sizes, one call inside a CUDA
graph of 28 calls on 28 weight copies (as in a step), median of replays: cuBLAS (F.linear) against a Triton GEMM
over tile shapes. Prints a table and writes JSON.

  python benchmarks/probe_gemm.py --out benchmarks/results/gemm_probe.json    # on the GPU
"""

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from probe_l2_prefetch import LAYERS, graph_us  # benchmarks/ is on the path when run as a script

from bench import save_json
from minivllm.testing.benchmark import COPY_BW, MATMUL_FLOPS

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}  # (N, K)


@triton.jit
def gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[M, N] = x[M, K] @ w[N, K].T, one program per (BM, BN) tile, all rows contiguous."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    x_ptrs = x_ptr + rm[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * K + rk[None, :]
    acc = tl.zeros((BM, BN), tl.float32)
    for _ in range(0, K, BK):  # K is a multiple of BK here
        x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptrs, mask=rn[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BK
        w_ptrs += BK
    tl.store(
        y_ptr + rm[:, None] * N + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def gemm(x, w, y, cfg):
    bm, bn, bk, warps, stages = cfg
    M, K = x.shape
    N = w.shape[0]
    gemm_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](
        x, w, y, M, N, K, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages
    )


@triton.jit
def gemm_split_k_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """y += x[M, K] @ w[N, K].T over K split in SPLIT parts, one program per (BM, BN) tile and part: fp32 atomics
    into y (M, N), or each part's sum stored in y (SPLIT, M, N) for the consumer to add up."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_part = K // SPLIT  # K is a multiple of SPLIT * BK here
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * k_part + tl.arange(0, BK)
    x_ptrs = x_ptr + rm[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * K + rk[None, :]
    acc = tl.zeros((BM, BN), tl.float32)
    for _ in range(0, k_part, BK):
        x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptrs, mask=rn[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BK
        w_ptrs += BK
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ATOMIC:
        tl.atomic_add(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=mask, sem="relaxed")
    else:
        tl.store(y_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)


def gemm_split_k(x, w, y, cfg):
    bm, bn, bk, split, atomic = cfg
    M, K = x.shape
    N = w.shape[0]
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), split)
    gemm_split_k_kernel[grid](
        x, w, y, M, N, K, BM=bm, BN=bn, BK=bk, SPLIT=split, ATOMIC=atomic, num_warps=4, num_stages=3
    )


def compare_split_k(args) -> None:
    """The two matmuls with 1,024 output columns (o and down: 8-16 tiles of 128 x 128 at batch 256, most SMs idle)
    with K split over programs, against cuBLAS. The split-K times leave out what a consumer would add: zeroing an
    atomic output for its next use, or adding up the stored parts (e.g. inside the following add + RMSNorm)."""
    configs = list(itertools.product((64, 128), (64, 128), (64, 128), (2, 4, 8), (True, False)))
    rows = []
    for name in ("o", "down"):
        N, K = SHAPES[name]
        ws = layer_weights(N, K)
        for M in map(int, args.batches.split(",")):
            x = activations(M, K)
            cublas = per_call_us(lambda i: F.linear(x, ws[i]))
            ref = F.linear(x, ws[0]).float()
            best = {}
            for cfg in configs:
                bm, bn, bk, split, atomic = cfg
                if K % (split * bk):
                    continue
                y = torch.zeros((1 if atomic else split) * M, N, device="cuda", dtype=torch.float32)
                t = timed_if_right(
                    f"{name} M={M} {cfg}",
                    ref,
                    lambda i, cfg=cfg, y=y: gemm_split_k(x, ws[i], y, cfg),
                    lambda y=y, atomic=atomic, split=split: y if atomic else y.view(split, M, N).sum(0),
                )
                if t is None:
                    continue
                if atomic not in best or t < best[atomic][1]:
                    best[atomic] = (cfg, t)
            rows.append(dict(shape=name, M=M, N=N, K=K, cublas_us=cublas, best={str(k): v for k, v in best.items()}))
            print(
                f"{name:5s} M={M:4d}: cuBLAS {cublas:6.2f} us  split-K atomic {best[True][1]:6.2f} us {best[True][0]}  "
                f"stored parts {best[False][1]:6.2f} us {best[False][0]}",
                flush=True,
            )
    save_json(dict(layers=LAYERS, rows=rows, device=torch.cuda.get_device_name()), args.out)


def layer_weights(N: int, K: int) -> list[torch.Tensor]:
    """One (N, K) bf16 weight per layer, so that 28 calls read 28 weights from DRAM, as in a step."""
    return [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(LAYERS)]


def activations(M: int, K: int) -> torch.Tensor:
    return torch.randn(M, K, device="cuda", dtype=torch.bfloat16)


def timed_if_right(label: str, ref: torch.Tensor, run, result) -> float | None:
    """run(0) once and compare result() with ref (within 2% of its largest value), then the per-call time of
    run(i) over the 28 layers; None, the reason printed, when the compiler refuses the tile shape (shared memory)
    or the result is wrong."""
    try:
        run(0)
        err = (result() - ref).abs().max().item()
        if err > 0.02 * ref.abs().max().item() + 1e-2:
            raise RuntimeError(f"wrong result, error {err}")
        return per_call_us(run)
    except Exception as e:
        print(f"  {label}: {type(e).__name__} {str(e)[:120]}", flush=True)
        return None


def per_call_us(fn) -> float:
    """Median microseconds per call of fn(i) captured for i = 0..27 in one CUDA graph."""
    return graph_us(lambda: [fn(i) for i in range(LAYERS)])  # graph_us divides by the 28 layers


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemm_probe.json")
    ap.add_argument("--batches", default="64,128,192,256")
    ap.add_argument(
        "--blas", action="store_true", help="only cuBLAS against cuBLASLt (torch.backends.cuda.preferred_blas_library)"
    )
    ap.add_argument("--split-k", action="store_true", help="only o and down: split-K Triton GEMMs against cuBLAS")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.blas:
        return compare_blas(args)
    if args.split_k:
        return compare_split_k(args)
    configs = [
        c
        for c in itertools.product((64, 128), (32, 64, 128), (64, 128), (4, 8), (3, 4))
        if (c[0] + c[1]) * c[2] * 2 * c[4] <= 200 * 1024
    ]
    rows = []
    for name, (N, K) in SHAPES.items():
        ws = layer_weights(N, K)
        for M in map(int, args.batches.split(",")):
            x = activations(M, K)
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            cublas = per_call_us(lambda i: F.linear(x, ws[i]))
            ref = F.linear(x, ws[0]).float()
            best = None
            for cfg in configs:
                t = timed_if_right(
                    f"{name} M={M} {cfg}", ref, lambda i, cfg=cfg: gemm(x, ws[i], y, cfg), lambda: y.float()
                )
                if t is None:
                    continue
                if best is None or t < best[1]:
                    best = (cfg, t)
            flops = 2 * M * N * K
            rows.append(
                dict(
                    shape=name,
                    M=M,
                    N=N,
                    K=K,
                    cublas_us=cublas,
                    triton_best_us=best[1],
                    best_config=best[0],
                    floor_us=max(flops / MATMUL_FLOPS, N * K * 2 / COPY_BW) * 1e6,
                )
            )
            print(
                f"{name:8s} M={M:4d}: cuBLAS {cublas:6.2f} us  Triton best {best[1]:6.2f} us {best[0]}  "
                f"floor {rows[-1]['floor_us']:.2f} us",
                flush=True,
            )
    save_json(
        dict(
            layers=LAYERS,
            rows=rows,
            device=torch.cuda.get_device_name(),  # save_json adds the date, command and versions
        ),
        args.out,
    )


def compare_blas(args) -> None:
    """F.linear through torch's two BLAS paths: cuBLAS (cublasGemmEx, torch's default for a plain matmul) and
    cuBLASLt (its own heuristics; torch uses it for matmuls with a bias). Same graphs of 28 calls."""
    rows = []
    for name, (N, K) in SHAPES.items():
        ws = layer_weights(N, K)
        for M in map(int, args.batches.split(",")):
            x = activations(M, K)
            row = dict(shape=name, M=M, N=N, K=K)
            for lib in ("cublas", "cublaslt", "cublas"):  # the default twice: its spread is the noise
                torch.backends.cuda.preferred_blas_library(lib)
                row.setdefault(f"{lib}_us", []).append(per_call_us(lambda i: F.linear(x, ws[i])))
            torch.backends.cuda.preferred_blas_library("cublas")
            rows.append(row)
            print(
                f"{name:8s} M={M:4d}: cuBLAS {' / '.join(f'{t:6.2f}' for t in row['cublas_us'])} us  "
                f"cuBLASLt {row['cublaslt_us'][0]:6.2f} us",
                flush=True,
            )
    save_json(dict(layers=LAYERS, rows=rows, device=torch.cuda.get_device_name()), args.out)


if __name__ == "__main__":
    main()
