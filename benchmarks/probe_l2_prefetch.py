"""Does an L2 prefetch of the next weight on a side stream make decode-batch matmuls faster? (GPU)

A CUDA graph runs what a decode step's matmuls run: 28 layers of Qwen3-0.6B's qkv, o, gate/up, SiLU-mul and down
projections on 28 weight copies (no weight stays in L2 between replays), optionally with a stand-in for decode
attention after qkv (one kernel reading batch x context x 4 KB of "KV cache" per layer, as the real one does).
Variants: `cold` (as the engine runs), `hot` (every layer on copy 0, the weights L2-resident: the bound a
prefetch can reach), and `pf` (before each matmul, the next matmul's weight prefetched into L2 from a side
stream: a one-warp kernel whose lanes each issue a bulk prefetch, `cp.async.bulk.prefetch.L2`, of one chunk).
Tried in the engine (commit 0a90a10) and not kept: benchmarks/NOTES.md part IX. Prints microseconds per layer
(median of replays) and writes JSON.

  python benchmarks/probe_l2_prefetch.py --out benchmarks/results/l2_prefetch_probe.json    # on the GPU
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import save_json
from minivllm.layers.activation import SiluAndMul
from minivllm.testing.benchmark import graph_replay_us

LAYERS = 28
H, QKV, Q, GU, INTER = 1024, 4096, 2048, 6144, 3072
KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 2  # K and V of one token in one layer: 8 KV heads x 128, bf16


# one lane issues one bulk prefetch of CHUNK bytes; a program has LANES lanes (one warp)
CHUNK = 64 * 1024
LANES = 32
# PTX: a bulk prefetch into L2, marked evict-last so the KV cache streaming past does not push it out first
PREFETCH_EVICT_LAST = tl.constexpr(
    "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
    "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }"
)
PREFETCH = tl.constexpr("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;")


@triton.jit
def l2_prefetch_kernel(base_ptr, n_bytes, CHUNK: tl.constexpr, LANES: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Lane i of program p prefetches bytes [c * CHUNK, (c + 1) * CHUNK) of the tensor, c = p * LANES + i."""
    c = tl.program_id(0) * LANES + tl.arange(0, LANES)
    off = c.to(tl.int64) * CHUNK
    size = tl.minimum(n_bytes - off, CHUNK)
    live = size > 0
    # every lane runs the instruction: a lane past the end prefetches the first 16 bytes again
    addr = tl.where(live, (base_ptr + off).to(tl.int64), base_ptr.to(tl.int64))
    size = tl.where(live, size, 16).to(tl.int32)
    if EVICT_LAST:
        tl.inline_asm_elementwise(PREFETCH_EVICT_LAST, "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(PREFETCH, "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(t: torch.Tensor, *, chunk: int | None = None, lanes: int = LANES, evict_last: bool = True) -> None:
    """Ask for contiguous CUDA tensor `t`'s bytes to be brought into L2 (on the current stream; returns at once)."""
    chunk = chunk or CHUNK
    if not (t.is_cuda and t.is_contiguous()):
        raise ValueError(f"l2 prefetch: needs a contiguous CUDA tensor, got device {t.device}, shape {tuple(t.shape)}")
    n_bytes = t.numel() * t.element_size()
    if n_bytes % 16 or t.data_ptr() % 16:
        raise ValueError(f"l2 prefetch: {n_bytes} bytes at {t.data_ptr():#x}: size and address must be multiples of 16")
    flat = t.view(-1).view(torch.uint8)
    grid = (triton.cdiv(triton.cdiv(n_bytes, chunk), lanes),)
    l2_prefetch_kernel[grid](flat, n_bytes, CHUNK=chunk, LANES=lanes, EVICT_LAST=evict_last, num_warps=1)


@triton.jit
def read_kernel(ptr, n, out_ptr, BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """Stand-in for decode attention's KV reads: sum n bf16 values, grid-stride."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if EVICT_FIRST:
            x = tl.load(ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(ptr + offs, mask=offs < n, other=0.0)
        acc += x.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def graph_us(fn) -> float:
    """Median microseconds per layer of `fn()` (all 28 layers) captured once in a CUDA graph."""
    return graph_replay_us(fn, per=LAYERS)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="l2_prefetch_probe.json")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--context", type=int, default=600)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    act = SiluAndMul()
    shapes = {"qkv": (QKV, H), "o": (H, Q), "gate_up": (GU, H), "down": (H, INTER)}
    ws = {
        k: [torch.randn(n, kk, device=dev, dtype=bf) / kk**0.5 for _ in range(LAYERS)] for k, (n, kk) in shapes.items()
    }
    order = ["qkv", "o", "gate_up", "down"]
    seq = [(i, k) for i in range(LAYERS) for k in order]  # the matmuls of a step in order
    side = torch.cuda.Stream()
    rows = []

    # the prefetch alone brings the weight in: prefetch then wait then matmul, against cold and hot
    x0 = torch.randn(8, H, device=dev, dtype=bf)
    for name, opts in (
        ("64K", {"chunk": 65536}),
        ("16K", {"chunk": 16384}),
        ("8K", {"chunk": 8192}),
        ("4K", {"chunk": 4096}),
        ("4K normal", {"chunk": 4096, "evict_last": False}),
    ):
        w = ws["gate_up"]
        try:
            t_pf = graph_us(lambda w=w, opts=opts: [prefetch(w[i], **opts) for i in range(LAYERS)])
            t_both = graph_us(
                lambda w=w, opts=opts: [(prefetch(w[i], **opts), F.linear(x0, w[i])) for i in range(LAYERS)]
            )
        except Exception as e:  # report which form the toolchain refuses
            print(f"prefetch {name}: FAILED {type(e).__name__}: {e}", flush=True)
            rows.append(dict(kind="prefetch_alone", variant=name, error=str(e)[:300]))
            continue
        t_cold = graph_us(lambda w=w: [F.linear(x0, w[i]) for i in range(LAYERS)])
        t_hot = graph_us(lambda w=w: [F.linear(x0, w[0]) for i in range(LAYERS)])
        rows.append(
            dict(
                kind="prefetch_alone",
                variant=name,
                prefetch_us=t_pf,
                prefetch_then_matmul_us=t_both,
                cold_us=t_cold,
                hot_us=t_hot,
            )
        )
        print(
            f"gate_up M=8 [{name}]: prefetch alone {t_pf:.2f} us, prefetch+matmul {t_both:.2f}, "
            f"matmul cold {t_cold:.2f}, hot {t_hot:.2f}",
            flush=True,
        )

    # what a pure read reaches (the ceiling decode attention is held to): torch's sum over 4 GiB, and a copy
    big = torch.randn(2 << 30, device=dev, dtype=bf)
    dst = torch.empty_like(big)
    for name, fn, nbytes in (
        ("sum (read)", lambda: big.sum(dtype=torch.float32), big.numel() * 2),
        ("copy (read+write)", lambda: dst.copy_(big), big.numel() * 4),
    ):
        ms = triton.testing.do_bench(fn, warmup=5, rep=50)
        rows.append(dict(kind="bandwidth", op=name, TBps=nbytes / ms / 1e9))
        print(f"bandwidth {name}: {nbytes / ms / 1e9:.2f} TB/s", flush=True)
    big = dst = None

    for M in map(int, args.batches.split(",")):
        x = torch.randn(M, H, device=dev, dtype=bf)
        attn_in = torch.randn(M, Q, device=dev, dtype=bf)
        kv_elems = M * args.context * KV_BYTES_PER_TOKEN // 2
        kv = [torch.randn(kv_elems, device=dev, dtype=bf) for _ in range(LAYERS)] if M >= 64 else None
        sink = torch.empty(132 * 4, device=dev, dtype=torch.float32)

        def step(variant: str, attention: str = "none", ahead: int = 1, opts: dict | None = None):
            def run():
                main = torch.cuda.current_stream()
                for j, (i, k) in enumerate(seq):
                    w = ws[k][0 if variant == "hot" else i]
                    if variant == "pf" and j + ahead < len(seq):
                        ni, nk = seq[j + ahead]
                        side.wait_stream(main)
                        with torch.cuda.stream(side):
                            prefetch(ws[nk][ni], **(opts or {}))
                    if k == "qkv":
                        F.linear(x, w)
                        if attention != "none":
                            read_kernel[(132 * 4,)](
                                kv[i],
                                kv[i].numel(),
                                sink,
                                BLOCK=2048,
                                EVICT_FIRST=attention == "evict_first",
                                num_warps=4,
                            )
                    elif k == "o":
                        F.linear(attn_in, w)
                    elif k == "gate_up":
                        h = act(F.linear(x, w))
                    else:
                        F.linear(h, w)
                if variant == "pf":
                    main.wait_stream(side)

            return graph_us(run)

        cases = [
            ("cold", "none", 1, None),
            ("hot", "none", 1, None),
            ("pf", "none", 1, {"chunk": 16384}),
            ("pf", "none", 1, {"chunk": 8192}),
            ("pf", "none", 1, {"chunk": 4096}),
            ("pf", "none", 2, {"chunk": 8192}),
        ]
        if kv is not None:
            cases += [
                ("cold", "normal", 1, None),
                ("pf", "normal", 1, {"chunk": 8192}),
                ("pf", "evict_first", 1, {"chunk": 8192}),
                ("pf", "normal", 1, {"chunk": 8192, "evict_last": False}),
            ]
        line = []
        for variant, attention, ahead, opts in cases:
            t = step(variant, attention, ahead, opts)
            label = f"{variant}{'' if variant != 'pf' else f'+{ahead}'}{'' if not opts else str(opts)}|attn={attention}"
            rows.append(
                dict(kind="chain", M=M, variant=variant, attention=attention, ahead=ahead, opts=opts, us_per_layer=t)
            )
            line.append(f"{label} {t:.2f}")
        print(f"M={M:4d} (us per layer): " + "  ".join(line), flush=True)
        kv = None  # free this batch's stand-in KV before the next
    save_json(
        dict(
            layers=LAYERS,
            context=args.context,
            rows=rows,
            device=torch.cuda.get_device_name(),  # save_json adds the date, command and versions
        ),
        args.out,
    )


if __name__ == "__main__":
    main()
