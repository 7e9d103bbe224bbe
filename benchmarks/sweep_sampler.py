"""Sweep the decode sampler's kernels on a GPU (minivllm/layers/sampler.py) over the benchmark's vocabulary
(151,936 bf16 logits a row) at the decode batches of bench.py: the Gumbel-max race the engine ran until change 33
(`gumbel_sample`, kept here: one Philox draw and two logarithms per logit) against the engine's inverse CDF
(`inverse_cdf_sample`, one draw per row: a pass that writes each tile's max and softmax mass, then one program per
row that finds the tile and the column), and the inverse CDF's launch settings.

Each variant is timed as a decode graph runs it: a CUDA graph of 10 calls, each over its own copy of the logits.
Variants of the inverse CDF (the engine's: tiles of 1,024 columns, 4 at a time, ~4 programs per SM, 4 warps):
`tN` N columns a tile, `tbN` N tiles a load, `smN` ~N programs per SM for the tiles kernel, `wN` N warps.
Variants with the engine's tile draw the same tokens as the engine's setting (the tiles, not the programs, fix the
sums); the column "same" says so (the race and other tile sizes draw differently: "-").

  python benchmarks/sweep_sampler.py --out sampler_sweep.txt
"""

import argparse

import torch
import triton
import triton.language as tl

from minivllm.layers.sampler import inverse_cdf_sample
from minivllm.testing.benchmark import graph_replay_us

# --- the race the engine ran on the GPU until change 33 (benchmarks/NOTES.md): the "race" column ------------


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


def gumbel_sample(logits, temperatures, seed, out=None, block: int = 1024, splits: int | None = None):
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


# --- the inverse CDF -------------------------------------------------------------------------------------


def graph_us(fn, inputs, temps, seed, out, reps: int = 10) -> float:
    """Microseconds per call in a CUDA graph of `reps` calls, each over its own logits copy (as in a decode graph,
    where the LM head has just written them): the median of 20 replays."""
    return graph_replay_us(lambda: [fn(x, temps, seed, out) for x in inputs[:reps]], per=reps, replays=20)


@torch.inference_mode()
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
        "race": lambda x, t, s, o: gumbel_sample(x, t, s, o),
        "cdf": lambda x, t, s, o: inverse_cdf_sample(x, t, s, o),
        "cdf sm2": lambda x, t, s, o: inverse_cdf_sample(x, t, s, o, per_sm=2),
        "cdf sm8": lambda x, t, s, o: inverse_cdf_sample(x, t, s, o, per_sm=8),
        "cdf sm16": lambda x, t, s, o: inverse_cdf_sample(x, t, s, o, per_sm=16),
        "cdf tb1": lambda x, t, s, o: inverse_cdf_sample(x, t, s, o, tiles_at_once=1),
        "cdf tb8": lambda x, t, s, o: inverse_cdf_sample(x, t, s, o, tiles_at_once=8),
        "cdf w8": lambda x, t, s, o: inverse_cdf_sample(x, t, s, o, num_warps=8),
        "cdf tb8 w8": lambda x, t, s, o: inverse_cdf_sample(x, t, s, o, tiles_at_once=8, num_warps=8),
        "cdf t2048": lambda x, t, s, o: inverse_cdf_sample(x, t, s, o, tile=2048),
    }
    same_draws = {name for name in variants if name.startswith("cdf") and " t2048" not in name}
    say(
        f"{'batch':>5} " + " ".join(f"{name:>13}" for name in variants) + "   (us per call, median; same tokens as cdf)"
    )
    for B in (1, 8, 32, 64, 128, 256):
        g = torch.Generator(device=dev).manual_seed(B)
        copies = [(torch.randn(B, args.vocab, device=dev, generator=g) * 3).to(torch.bfloat16) for _ in range(10)]
        logits = copies[0]
        temps = torch.full((B,), 0.6, device=dev)
        temps[::7] = 0.0  # a few greedy rows
        ref = inverse_cdf_sample(logits, temps, torch.tensor([123], device=dev))
        assert torch.equal(ref[::7], logits[::7].argmax(-1)), "greedy rows must be the argmax"
        row, agree = [], []
        for name, fn in variants.items():
            out = torch.empty(B, dtype=torch.int64, device=dev)
            fn(logits, temps, torch.tensor([123], device=dev), out)
            agree.append("yes" if torch.equal(out, ref) else "NO") if name in same_draws else agree.append("-")
            us = graph_us(fn, copies, temps, torch.tensor([5], device=dev), out)
            row.append(f"{us:13.1f}")
        say(f"{B:>5} " + " ".join(row) + "   " + " ".join(agree))
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
