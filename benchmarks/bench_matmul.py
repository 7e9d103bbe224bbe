"""Decode-batch matmuls on the GPU: cuBLAS (F.linear, + SiluAndMul for gate/up) against our Triton kernel
(minivllm/layers/skinny_gemm.py) over its configurations, for Qwen3-0.6B's four per-layer projections at the
batch sizes a decode step meets. Each time is one call inside a CUDA graph of 28 calls on 28 different weight
copies (as in a step: no weight stays in L2), median of 20 replays; bytes/s counts the weights read.

  python benchmarks/bench_matmul.py --out benchmarks/results/matmul_gpu.json     # on the GPU
"""
import argparse
import itertools
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import save_json  # noqa: E402
from minivllm.layers.activation import SiluAndMul  # noqa: E402
from minivllm.layers.skinny_gemm import default_config, skinny_linear  # noqa: E402

CEILING = 4.28e12
SHAPES = {"qkv_proj": (4096, 1024, False), "o_proj": (1024, 2048, False),
          "gate_up+silu": (6144, 1024, True), "down_proj": (1024, 3072, False)}   # name -> (N, K, silu_mul)
LAYERS = 28


def graph_time_us(fn, n: int = LAYERS, reps: int = 20) -> float:
    """Median microseconds per call of fn(i) (i = layer) captured n times in one CUDA graph."""
    for i in range(n):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fn(i)
    times = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(times[3:])


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="matmul_gpu.json")
    ap.add_argument("--batches", default="1,8,16,32,64,128")
    args = ap.parse_args()
    torch.manual_seed(0)
    act = SiluAndMul()
    rows, lines = [], []
    configs = list(itertools.product((16, 32, 64), (128, 256), (4,), (3, 5)))
    for name, (N, K, silu) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(LAYERS)]
        wbytes = N * K * 2
        for M in map(int, args.batches.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = act(F.linear(x, ws[0])) if silu else F.linear(x, ws[0])
            got = skinny_linear(x, ws[0], silu_mul=silu)
            err = (got.float() - ref.float()).abs().max().item()
            tol = 0.02 * ref.float().abs().max().item() + 1e-2
            if err > tol:
                raise SystemExit(f"{name} M={M}: skinny_linear differs from cuBLAS by {err} (tol {tol})")
            cublas = graph_time_us((lambda i: act(F.linear(x, ws[i]))) if silu else (lambda i: F.linear(x, ws[i])))
            best = None
            for cfg in configs:
                t = graph_time_us(lambda i: skinny_linear(x, ws[i], silu_mul=silu, config=cfg))
                if best is None or t < best[1]:
                    best = (cfg, t)
            dflt = graph_time_us(lambda i: skinny_linear(x, ws[i], silu_mul=silu))
            row = dict(shape=name, N=N, K=K, M=M, cublas_us=round(cublas, 2), triton_default_us=round(dflt, 2),
                       default_config=list(default_config(M, N // 2 if silu else N)), triton_best_us=round(best[1], 2),
                       best_config=list(best[0]), cublas_TBps=round(wbytes / cublas / 1e6, 2),
                       triton_default_TBps=round(wbytes / dflt / 1e6, 2), max_abs_err=err)
            rows.append(row)
            lines.append(f"{name:13s} M={M:4d}: cuBLAS {cublas:6.2f} us ({row['cublas_TBps']:.2f} TB/s)  "
                         f"triton default {dflt:6.2f} us ({row['triton_default_TBps']:.2f} TB/s)  "
                         f"best {best[1]:6.2f} us {best[0]}")
            print(lines[-1], flush=True)
    save_json(dict(ceiling_Bps=CEILING, layers=LAYERS, rows=rows), args.out)


if __name__ == "__main__":
    main()
