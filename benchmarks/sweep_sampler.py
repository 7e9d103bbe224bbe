"""Sweep the decode sampler's race kernel on a GPU (minivllm/layers/sampler.py, `gumbel_sample`): the kernel as
the engine runs it against variants of its arithmetic and launch, over the benchmark's vocabulary (151,936 bf16
logits a row) at the decode batches of bench.py. Each variant is checked against the engine's kernel first:
same noise (the same Philox counters), so the same tokens except where two scores differ by a rounding.

Variants (a variant kernel lives here, not in the engine, until it is measured and adopted):
- `log2`: the score in base 2, l * (log2(e) / T) - log2(-log2(u)), the same argmax as l / T - log(-log(u))
  (a positive scale and a constant shift), with one reciprocal per row instead of a division per logit;
- `spN`: enough splits of each row for ~N programs per SM (the engine's heuristic: 2);
- `wN`: N warps per program; `rN`: N Philox rounds (10 is Triton's default; measured only, to see its cost).

  python benchmarks/sweep_sampler.py --out sampler_sweep.txt
"""

import argparse

import torch
import triton
import triton.language as tl

from minivllm.layers.sampler import gumbel_reduce_kernel, gumbel_sample

LOG2E = 1.4426950408889634


@triton.jit
def _fold2(row_ptr, cols, end, u, k, greedy, best, best_col):
    logit = tl.load(row_ptr + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
    e2 = tl.maximum(-tl.log2(u), 8.6e-8)  # -log2(u) = E * log2(e), E ~ Exp(1)
    score = tl.where(greedy, logit, logit * k - tl.log2(e2))
    better = score > best
    return tl.where(better, score, best), tl.where(better, cols, best_col)


@triton.jit
def race_log2_kernel(
    logits_ptr, stride, temps_ptr, seed_ptr, best_ptr, best_idx_ptr, V, CHUNK, BLOCK: tl.constexpr, ROUNDS: tl.constexpr
):
    row, split = tl.program_id(0), tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    t = tl.load(temps_ptr + row)
    greedy = t <= 0
    k = 1.4426950408889634 / tl.where(greedy, 1.0, t)  # log2(e) / T, once per program
    seed = tl.load(seed_ptr)
    offs = tl.arange(0, BLOCK)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, V)
    best = tl.full((BLOCK,), -float("inf"), tl.float32)
    best_col = start + offs
    for c in range(start, end, 4 * BLOCK):
        u0, u1, u2, u3 = tl.rand4x(seed, row * ((V + 3) // 4) + c // 4 + offs, n_rounds=ROUNDS)
        best, best_col = _fold2(row_ptr, c + offs, end, u0, k, greedy, best, best_col)
        best, best_col = _fold2(row_ptr, c + BLOCK + offs, end, u1, k, greedy, best, best_col)
        best, best_col = _fold2(row_ptr, c + 2 * BLOCK + offs, end, u2, k, greedy, best, best_col)
        best, best_col = _fold2(row_ptr, c + 3 * BLOCK + offs, end, u3, k, greedy, best, best_col)
    m = tl.max(best, axis=0)
    col = tl.min(tl.where(best == m, best_col, V), axis=0)
    tl.store(best_ptr + row * tl.num_programs(1) + split, m)
    tl.store(best_idx_ptr + row * tl.num_programs(1) + split, col)


def race_log2(logits, temperatures, seed, out, *, block=1024, per_sm=2, warps=4, rounds=10):
    B, V = logits.shape
    step = 4 * block
    sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
    splits = max(1, min(triton.cdiv(per_sm * sms, B), triton.cdiv(V, step)))
    chunk = triton.cdiv(triton.cdiv(V, splits), step) * step
    splits = triton.cdiv(V, chunk)
    best = torch.empty(B, splits, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(B, splits, dtype=torch.int32, device=logits.device)
    race_log2_kernel[(B, splits)](
        logits,
        logits.stride(0),
        temperatures,
        seed,
        best,
        best_idx,
        V,
        chunk,
        BLOCK=block,
        ROUNDS=rounds,
        num_warps=warps,
    )
    block_s = triton.next_power_of_2(max(splits, triton.cdiv(V, step)))
    gumbel_reduce_kernel[(B,)](best, best_idx, out, seed, splits, BLOCK_S=block_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sampler_sweep.txt")
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    dev = "cuda"
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    variants = {
        "engine": lambda x, t, s, o: gumbel_sample(x, t, s, o),
        "log2": lambda x, t, s, o: race_log2(x, t, s, o),
        "log2 sp4": lambda x, t, s, o: race_log2(x, t, s, o, per_sm=4),
        "log2 sp8": lambda x, t, s, o: race_log2(x, t, s, o, per_sm=8),
        "log2 sp8 w8": lambda x, t, s, o: race_log2(x, t, s, o, per_sm=8, warps=8),
        "log2 sp16": lambda x, t, s, o: race_log2(x, t, s, o, per_sm=16),
        "log2 sp8 b512": lambda x, t, s, o: race_log2(x, t, s, o, per_sm=8, block=512),
        "log2 sp8 r7": lambda x, t, s, o: race_log2(x, t, s, o, per_sm=8, rounds=7),
    }
    say(f"{'batch':>5} " + " ".join(f"{name:>14}" for name in variants) + "   (us per call; same tokens as engine)")
    for B in (1, 8, 32, 64, 128, 256):
        g = torch.Generator(device=dev).manual_seed(B)
        logits = (torch.randn(B, args.vocab, device=dev, generator=g) * 3).to(torch.bfloat16)
        temps = torch.full((B,), 0.6, device=dev)
        temps[::7] = 0.0  # a few greedy rows
        ref = gumbel_sample(logits, temps, torch.tensor([123], device=dev))
        row, agree = [], []
        for name, fn in variants.items():
            out = torch.empty(B, dtype=torch.int64, device=dev)
            fn(logits, temps, torch.tensor([123], device=dev), out)
            same = (out == ref).float().mean().item() if "r7" not in name else float("nan")
            seed = torch.tensor([5], device=dev)
            us = triton.testing.do_bench(lambda: fn(logits, temps, seed, out), warmup=25, rep=200, return_mode="median")
            row.append(f"{us * 1e3:14.1f}")
            agree.append(same)
        say(f"{B:>5} " + " ".join(row) + "   " + " ".join("-" if a != a else f"{a:.3f}" for a in agree))
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
