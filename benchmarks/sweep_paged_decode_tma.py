"""The paged decode kernel with its K/V tiles loaded by the Tensor Memory Accelerator (TMA: a host-made tensor
descriptor over the cache viewed as (slots, KV heads, head_dim), one box of BLOCK_N tokens x 1 head x D per tile)
against the engine's kernel (minivllm/layers/paged_decode.py, gathered loads through cp.async) on the benchmark's
decode phases (sweep_paged_decode.py's PHASES). A tile of BLOCK_N tokens lies inside one page (BLOCK_N divides the
page size and tiles start at multiples of BLOCK_N), so one page-table entry gives the box's first slot; rows past
the context are loaded and masked out of the scores. Checked against the engine's kernel before timing.

  python benchmarks/sweep_paged_decode_tma.py --out tma.txt
"""

import argparse

import torch
import triton
import triton.language as tl
import triton.testing
from sweep_paged_decode import HKV, PHASES, D, inputs  # benchmarks/ is on the path when run as a script
from triton.tools.tensor_descriptor import TensorDescriptor

from minivllm.layers.paged_decode import combine_splits_kernel, num_splits, paged_decode


@triton.jit(do_not_specialize=["num_splits", "table_stride"])
def paged_decode_tma_kernel(
    q_ptr,
    k_desc,
    v_desc,
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
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    kvh, b = tl.program_id(0), tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + (b * NUM_KV_HEADS * GROUP + heads)[:, None] * D + d[None, :], mask=g[:, None] < GROUP, other=0.0
    )
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)
    m = tl.full((BLOCK_G,), -float("inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    qk_scale = scale * 1.4426950408889634
    for n0 in range(start, end, BLOCK_N):
        page = tl.load(block_tables_ptr + b * table_stride + n0 // PAGE)
        slot = page * PAGE + n0 % PAGE
        k = k_desc.load([slot, kvh, 0]).reshape(BLOCK_N, D)
        v = v_desc.load([slot, kvh, 0]).reshape(BLOCK_N, D)
        valid = n0 + n < end
        s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * qk_scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_offs = ((b * NUM_KV_HEADS * GROUP + heads)[:, None] * num_splits + split) * D + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=g[:, None] < GROUP)
    if SPLIT:
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), -float("inf"))
        tl.store(lse_ptr + (b * NUM_KV_HEADS * GROUP + heads) * num_splits + split, lse, mask=g < GROUP)


def paged_decode_tma(q, k_cache, v_cache, context_lens, block_tables, scale, *, block_n=128, warps=4, stages=4):
    B, Hq, Dh = q.shape
    nb, page, hkv, _ = k_cache.shape
    splits = num_splits(B, hkv)
    kd = TensorDescriptor(k_cache, [nb * page, hkv, Dh], [hkv * Dh, Dh, 1], [block_n, 1, Dh])
    vd = TensorDescriptor(v_cache, [nb * page, hkv, Dh], [hkv * Dh, Dh, 1], [block_n, 1, Dh])
    out = torch.empty_like(q)
    partial = out if splits == 1 else torch.empty(B, Hq, splits, Dh, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device) if splits > 1 else partial
    paged_decode_tma_kernel[(hkv, B, splits)](
        q,
        kd,
        vd,
        block_tables,
        context_lens,
        partial,
        lse,
        scale,
        block_tables.stride(0),
        splits,
        NUM_KV_HEADS=hkv,
        GROUP=Hq // hkv,
        D=Dh,
        PAGE=page,
        BLOCK_G=max(16, triton.next_power_of_2(Hq // hkv)),
        BLOCK_N=block_n,
        SPLIT=splits > 1,
        num_warps=warps,
        num_stages=stages,
    )
    if splits > 1:
        combine_splits_kernel[(B * Hq,)](
            partial, lse, out, splits, D=Dh, BLOCK_S=16, BLOCK_D=triton.next_power_of_2(Dh), PDL=False
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tma.txt")
    args = ap.parse_args()
    lines = []
    variants = {
        "tma 128/4w/4s": dict(),
        "tma 128/4w/3s": dict(stages=3),
        "tma 128/8w/3s": dict(warps=8, stages=3),
        "tma 64/4w/4s": dict(block_n=64),
        "tma 256/8w/2s": dict(block_n=256, warps=8, stages=2),
    }
    head = f"{'phase':<18} {'engine us':>10} " + " ".join(f"{n:>15}" for n in variants) + "  (TB/s engine; max |diff|)"
    print(head)
    lines.append(head)
    for B, lo, hi in PHASES:
        q, k, v, lens, tables = inputs(B, lo, hi, False)
        scale = D**-0.5
        ref = paged_decode(q, k, v, lens, tables, scale)
        nbytes = int(lens.sum()) * HKV * D * 2 * 2
        t_ref = triton.testing.do_bench(lambda: paged_decode(q, k, v, lens, tables, scale), return_mode="median")
        cells, diffs = [], []
        for kw in variants.values():
            try:
                got = paged_decode_tma(q, k, v, lens, tables, scale, **kw)
                diffs.append(f"{(got.float() - ref.float()).abs().max().item():.3f}")
                t = triton.testing.do_bench(
                    lambda: paged_decode_tma(q, k, v, lens, tables, scale, **kw), return_mode="median"
                )
                cells.append(f"{t * 1e3:15.1f}")
            except Exception as e:  # a configuration that does not compile or fit
                cells.append(f"{'fail':>15}")
                diffs.append(type(e).__name__)
        line = (
            f"{B:>4} x {lo}-{hi:<7} {t_ref * 1e3:10.1f} "
            + " ".join(cells)
            + f"  ({nbytes / (t_ref * 1e-3) / 1e12:.2f}; "
            + " ".join(diffs)
            + ")"
        )
        print(line, flush=True)
        lines.append(line)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
