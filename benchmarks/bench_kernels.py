"""Kernel micro-benchmarks (llm.c's habit: check each kernel against a reference, then time it):

- store_kvcache (minivllm/kernels/triton/store_kvcache.py): Qwen3-0.6B's per-layer K/V (8 KV heads x 128, bf16) for
  N new tokens scattered to random slots; bytes = K and V read + written (+ the slot mapping);
- paged decode attention (the backend's own_decode) per available backend: 256 sequences x ~1k context,
  block size 256, 16 q heads / 8 KV heads, head_dim 128, bf16; bytes = each sequence's K/V context read
  once + q read + o written (+ block tables and lengths).

Each is reported as achieved bytes/s against the H200's measured copy ceiling, 4.28 TB/s read+write
(benchmarks/RESULTS.md). CUDA timings are `triton.testing.do_bench` medians after a warm-up (it flushes L2
between runs); on CPU (`--cpu-small`, the default without CUDA) tiny sizes and wall-clock medians, only to
test the script.

  python benchmarks/bench_kernels.py                       # on the GPU
  python benchmarks/bench_kernels.py --cpu-small --out /tmp/k.json
"""

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers
import torch

import minivllm  # noqa: F401  (TRITON_INTERPRET=1 without CUDA)
from helpers.benchmark import COPY_BW as CEILING
from helpers.benchmark import save_json
from minivllm.kernels import attention_backends
from minivllm.kernels.triton.paged_decode import paged_decode
from minivllm.kernels.triton.store_kvcache import store_kvcache
from minivllm.layers.attention import store_kvcache_torch


@dataclass
class Result:
    kernel: str
    backend: str
    shape: str
    median_us: float
    bytes: int
    bytes_per_s: float
    fraction_of_ceiling: float
    checked: str  # what the output was compared with before timing


def time_us(fn, cuda: bool, reps: int) -> float:
    """Median microseconds of fn() after a warm-up (JIT compile, caches)."""
    for _ in range(3):
        fn()
    if cuda:
        import triton.testing

        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def result(kernel, backend, shape, us, nbytes, checked) -> Result:
    bw = nbytes / (us * 1e-6)
    return Result(kernel, backend, shape, round(us, 2), nbytes, bw, bw / CEILING, checked)


# --- store_kvcache ---------------------------------------------------------------------------------------


def bench_store(N: int, kv_heads: int, head_dim: int, block_size: int, device: str, reps: int) -> Result:
    g = torch.Generator().manual_seed(N)
    dtype = torch.bfloat16
    num_blocks = -(-2 * N // block_size)  # room for 2N tokens
    key = torch.randn(N, kv_heads, head_dim, generator=g).to(device, dtype)  # (N, kv_heads, head_dim)
    value = torch.randn(N, kv_heads, head_dim, generator=g).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:N].to(device, torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    store_kvcache_torch(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), "store_kvcache != index assignment"
    us = time_us(lambda: store_kvcache(key, value, k_cache, v_cache, slots), device == "cuda", reps)
    nbytes = 2 * 2 * key.numel() * key.element_size() + slots.numel() * 4  # K, V read + written; slots read
    return result("store_kvcache", "triton", f"N={N} kv={kv_heads}x{head_dim} bf16", us, nbytes, "== index assignment")


# --- paged decode attention ------------------------------------------------------------------------------


def decode_inputs(num_seqs, mean_ctx, block_size, heads, kv_heads, head_dim, device):
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    lens = torch.randint(mean_ctx * 3 // 4, mean_ctx * 5 // 4 + 1, (num_seqs,), generator=g)  # ~mean_ctx
    needed = (lens + block_size - 1) // block_size
    num_blocks = int(needed.sum()) + 1
    order = torch.randperm(num_blocks, generator=g)  # scattered blocks
    tables = torch.full((num_seqs, int(needed.max()) + 1), -1, dtype=torch.int32)  # -1 padded, as the runner does
    used = 0
    for i, n in enumerate(needed.tolist()):
        tables[i, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(device, dtype)  # finite everywhere
    v_cache = torch.randn(shape, generator=g).to(device, dtype)
    q = torch.randn(num_seqs, heads, head_dim, generator=g).to(device, dtype)  # (B, H, D)
    return q, k_cache, v_cache, lens.to(device, torch.int32), tables.to(device)


def bench_decode(backends, num_seqs, mean_ctx, block_size, heads, kv_heads, head_dim, device, reps) -> list[Result]:
    q, k_cache, v_cache, lens, tables = decode_inputs(num_seqs, mean_ctx, block_size, heads, kv_heads, head_dim, device)
    scale = head_dim**-0.5
    expected = attention_backends.create("torch").decode(
        q.float(), k_cache.float(), v_cache.float(), lens, tables, scale
    )
    elem = q.element_size()
    nbytes = (
        2 * int(lens.sum()) * kv_heads * head_dim * elem  # K and V of every context, once
        + 2 * q.numel() * elem  # q read, o written
        + tables.numel() * 4
        + lens.numel() * 4
    )
    shape = f"B={num_seqs} ctx~{mean_ctx} bs={block_size} h={heads}/{kv_heads}x{head_dim} bf16"

    def decode_fn(backend: str):
        if backend == "triton":  # minivllm/kernels/triton/paged_decode.py (the flash backends' decode)
            return lambda: paged_decode(q, k_cache, v_cache, lens, tables.clamp(min=0), scale)
        table = tables if backend == "torch" else tables.clamp(min=0)  # as the layer passes them
        decode = attention_backends.create(backend).own_decode
        return lambda: decode(q, k_cache, v_cache, lens, table, scale)

    out = []
    # a flash backend's row times its own decode kernel (its `own_decode`)
    for backend in backends + (["triton"] if "fa4" in backends or "flash_attn" in backends else []):
        if backend == "flash_attn" and block_size % 256:
            print(f"skip decode/{backend}: paged KV needs block_size % 256 == 0", file=sys.stderr)
            continue
        fn = decode_fn(backend)
        diff = (fn().float() - expected).abs().max().item()
        assert diff < 2e-2, f"decode/{backend}: max abs diff {diff:.3e} vs the fp32 torch backend"
        us = time_us(fn, device == "cuda", reps)
        out.append(result("paged_decode", backend, shape, us, nbytes, f"fp32 torch, max diff {diff:.1e}"))
    return out


# --- main ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-small", action="store_true", help="tiny sizes on CPU (default when there is no CUDA)")
    ap.add_argument("--backends", nargs="*", default=None, help="decode backends (default: all available)")
    ap.add_argument("--reps", type=int, default=5, help="CPU timing repetitions (CUDA uses do_bench)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels_<gpu|cpu>.json)")
    args = ap.parse_args()
    small = args.cpu_small or not torch.cuda.is_available()
    device = "cpu" if small else "cuda"
    backends = args.backends or attention_backends.available(device)

    if small:  # shapes of the real thing, scaled down for the Triton interpreter and a CPU
        store_cases = [dict(N=16, kv_heads=8, head_dim=128), dict(N=64, kv_heads=8, head_dim=128)]
        decode_case = dict(num_seqs=8, mean_ctx=64, block_size=16, heads=16, kv_heads=8, head_dim=64)
    else:
        store_cases = [dict(N=256, kv_heads=8, head_dim=128), dict(N=16384, kv_heads=8, head_dim=128)]
        decode_case = dict(num_seqs=256, mean_ctx=1024, block_size=256, heads=16, kv_heads=8, head_dim=128)

    results = [
        bench_store(**c, block_size=decode_case["block_size"], device=device, reps=args.reps) for c in store_cases
    ]
    results += bench_decode(backends, **decode_case, device=device, reps=args.reps)
    if not small:  # the decode batches of the benchmark's tail and middle
        for num_seqs, ctx in ((8, 1500), (32, 1400), (64, 1200), (128, 1000), (256, 64)):
            results += bench_decode(
                [b for b in backends if b != "torch"],
                **{**decode_case, "num_seqs": num_seqs, "mean_ctx": ctx},
                device=device,
                reps=args.reps,
            )

    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    print(f"device: {name} | ceiling {CEILING / 1e12:.2f} TB/s (H200 copy, read+write)")
    print(f"{'kernel':<14} {'backend':<11} {'shape':<46} {'median us':>10} {'GB/s':>9} {'of ceiling':>10}")
    for r in results:
        print(
            f"{r.kernel:<14} {r.backend:<11} {r.shape:<46} {r.median_us:>10.1f} {r.bytes_per_s / 1e9:>9.2f} "
            f"{r.fraction_of_ceiling:>9.1%}"
        )

    report = dict(
        device=name,
        device_kind=device,
        ceiling_bytes_per_s=CEILING,
        timing="triton.testing.do_bench median" if device == "cuda" else f"perf_counter median of {args.reps}",
        results=[asdict(r) for r in results],
    )
    save_json(
        report,
        args.out or os.path.join("benchmarks", "results", f"kernels_{'gpu' if device == 'cuda' else 'cpu'}.json"),
    )


if __name__ == "__main__":
    main()
