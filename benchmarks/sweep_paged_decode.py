"""Sweep of the Triton paged decode kernel's launch configuration (minivllm/kernels/triton/paged_decode.py) on the GPU,
on Qwen3-0.6B's per-layer shape (16 q heads / 8 KV heads x 128, bf16, block size 256) at batches and context
mixes of the benchmark workload; also the same batch ordered longest context first. Times are
triton.testing.do_bench medians (L2 flushed), bytes = K and V of every context once.
--grid: instead of the tiles, the split count and the order of the programs (batch or KV heads fastest) at the
default tiles, on the batches and contexts of the benchmark's phases (from 256 sequences of 100-1,500 tokens
down to 8 of 1,200-2,048).
--graph (with --grid): time what a decode graph runs instead of one call between L2 flushes: the
calls of all 28 layers (each its own K/V cache) captured in one CUDA graph, per layer. Single calls of a few tens
of microseconds read bimodally from run to run (HISTORY.md, 2026-12-01); the graph's replays do not.

  python benchmarks/sweep_paged_decode.py --out benchmarks/results/sweep_paged_decode.json
  python benchmarks/sweep_paged_decode.py --grid --out benchmarks/results/sweep_paged_decode_grid.json
  python benchmarks/sweep_paged_decode.py --grid --graph --out sweep_paged_decode_grid_graph.json
"""

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers
import torch
import triton.testing

from helpers.benchmark import save_json
from minivllm.kernels.torch_attention import paged_decode_attention
from minivllm.kernels.triton.paged_decode import HEADS_FASTEST, num_splits, paged_decode

H, HKV, D, PAGE = 16, 8, 128, 256
SCENARIOS = [(256, 600, 600), (256, 100, 1500), (128, 300, 1800), (64, 500, 2000), (16, 1000, 2000)]  # B, ctx lo, hi
PHASES = [(256, 100, 1500), (128, 300, 1800), (96, 400, 1900), (64, 500, 2000), (32, 700, 2000), (16, 1000, 2000)]
PHASES += [(8, 1200, 2048), (1, 1500, 2048)]
LAYERS = 28  # Qwen3-0.6B's
MAX_MODEL_LEN = 4096  # the benchmark's: a decode graph's block tables are MAX_MODEL_LEN / PAGE wide


def inputs(B, lo, hi, longest_first):
    g = torch.Generator().manual_seed(B + lo)
    lens = torch.randint(lo, hi + 1, (B,), generator=g)
    if longest_first:
        lens = lens.sort(descending=True).values
    pages = (lens + PAGE - 1) // PAGE
    order = torch.randperm(int(pages.sum()), generator=g)
    tables = torch.zeros(B, int(pages.max()), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages.tolist()):
        tables[i, :n] = order[used : used + n]
        used += n
    k = torch.randn(int(pages.sum()), PAGE, HKV, D, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(int(pages.sum()), PAGE, HKV, D, generator=g).to("cuda", torch.bfloat16)
    q = torch.randn(B, H, D, generator=g).to("cuda", torch.bfloat16)
    return q, k, v, lens.to("cuda", torch.int32), tables.cuda()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep_paged_decode.json")
    ap.add_argument("--grid", action="store_true", help="sweep split counts and program order, not tiles")
    ap.add_argument("--graph", action="store_true", help="time 28 layers' calls replayed in one CUDA graph")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_paged_decode.py times the Triton kernel on a GPU; none here")
    if args.grid:
        return sweep_grid(args.out, graph=args.graph)
    configs = list(itertools.product((32, 64, 128), (4, 8), (2, 3, 4)))  # block_n, num_warps, num_stages
    rows = []
    for (B, lo, hi), longest_first in itertools.product(SCENARIOS, (False, True)):
        q, k, v, lens, tables = inputs(B, lo, hi, longest_first)
        ref = paged_decode_attention(q.float(), k.float(), v.float(), lens, tables, D**-0.5)
        nbytes = 2 * int(lens.sum()) * HKV * D * 2
        times = {}
        for bn, w, st in configs:
            fn = lambda: paged_decode(q, k, v, lens, tables, D**-0.5, block_n=bn, num_warps=w, num_stages=st)
            try:
                err = (fn().float() - ref).abs().max().item()
            except Exception as e:  # e.g. out of shared memory
                print(f"  skip {bn, w, st}: {type(e).__name__}")
                continue
            assert err < 2e-2, f"config {bn, w, st}: max abs diff {err}"
            times[bn, w, st] = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        base = times[64, 4, 3]
        best = min(times, key=times.get)
        row = dict(
            batch=B,
            ctx=[lo, hi],
            longest_first=longest_first,
            default_us=round(base, 1),
            default_TBps=round(nbytes / base / 1e6, 2),
            best=list(best),
            best_us=round(times[best], 1),
            best_TBps=round(nbytes / times[best] / 1e6, 2),
            all_us={f"{bn}/{w}/{st}": round(t, 1) for (bn, w, st), t in times.items()},
        )
        rows.append(row)
        print(
            f"B={B:3d} ctx {lo}-{hi} longest_first={longest_first!s:5}: default {base:7.1f} us "
            f"({row['default_TBps']} TB/s)  best {best} {times[best]:7.1f} us ({row['best_TBps']} TB/s)",
            flush=True,
        )
    save_json(dict(rows=rows), args.out)


def time_in_graph(q, caches, lens, tables, kwargs) -> float:
    """Microseconds per layer of one paged_decode call per layer cache in `caches` (LAYERS of them), replayed in one
    CUDA graph (the KV bytes of all layers together far exceed the L2, so every call reads DRAM as a step does)."""
    step = lambda: [paged_decode(q, kc, vc, lens, tables, D**-0.5, **kwargs) for kc, vc in caches]
    ms = triton.testing.do_bench_cudagraph(step, rep=100, return_mode="median")
    return ms * 1e3 / len(caches)


def sweep_grid(out: str, graph: bool = False) -> None:
    """Split counts x program order (batch or KV heads fastest) at the default tiles, per phase of the benchmark,
    each checked against the reference first; the engine's choice (num_splits(B), its program order) beside the
    best. With `graph`, per-layer times of LAYERS calls in one CUDA graph (time_in_graph) over block tables as
    wide as a decode graph's (MAX_MODEL_LEN / PAGE, padded with valid ids)."""
    rows = []
    for B, lo, hi in PHASES:
        q, k, v, lens, tables = inputs(B, lo, hi, longest_first=False)
        if graph:
            pad = tables[:, :1].expand(B, MAX_MODEL_LEN // PAGE - tables.shape[1])
            tables = torch.cat([tables, pad], dim=1).contiguous()
            caches = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(LAYERS - 1)]
        ref = paged_decode_attention(q.float(), k.float(), v.float(), lens, tables, D**-0.5)
        nbytes = 2 * int(lens.sum()) * HKV * D * 2
        counts = sorted({1, 2, 3, 4, 6, 8, 12, 16, num_splits(B, HKV)})
        times = {}
        for splits, heads in itertools.product(counts, (False, True)):
            label, kwargs = f"{splits}/{'heads' if heads else 'batch'}", dict(splits=splits, heads_fastest=heads)
            fn = lambda: paged_decode(q, k, v, lens, tables, D**-0.5, **kwargs)
            err = (fn().float() - ref).abs().max().item()
            assert err < 2e-2, f"{label}: max abs diff {err}"
            if graph:
                times[label] = time_in_graph(q, caches, lens, tables, kwargs)
            else:
                times[label] = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        engine = f"{num_splits(B, HKV)}/{'heads' if HEADS_FASTEST else 'batch'}"
        now, best = times[engine], min(times, key=times.get)
        row = dict(
            batch=B,
            ctx=[lo, hi],
            engine=engine,
            engine_us=round(now, 1),
            engine_TBps=round(nbytes / now / 1e6, 2),
            best=best,
            best_us=round(times[best], 1),
            best_TBps=round(nbytes / times[best] / 1e6, 2),
            all_us={label: round(t, 1) for label, t in times.items()},
        )
        rows.append(row)
        print(
            f"B={B:3d} ctx {lo}-{hi}: engine ({row['engine']}) {now:7.1f} us ({row['engine_TBps']} TB/s)  "
            f"best {best} {times[best]:7.1f} us ({row['best_TBps']} TB/s)\n   "
            + " ".join(f"{label}:{t}" for label, t in row["all_us"].items()),
            flush=True,
        )
    save_json(dict(rows=rows, graph=graph), out)


if __name__ == "__main__":
    main()
