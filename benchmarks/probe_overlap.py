"""Can one half of a decode batch's attention run beside the other half's matmuls? (GPU)

At batch 128-256 a decode step spends ~3/4 of its time in attention, which streams the KV cache at the read
ceiling, and ~1.2 ms in matmuls and small kernels that use a fraction of the bandwidth (benchmarks/NOTES.md parts IX
and X). Change 32 ran two halves of the batch on two streams with no order between them: slower, because both
halves reached attention together and an attention kernel puts programs on every SM (one per KV head, sequence
and split, ~3 at a time on an SM), so the other stream's kernels waited for its last program to be placed.

This probe times what one decode step's 28 layers run (random Qwen3-0.6B-shaped weights, 28 KV caches), captured
in one CUDA graph, under three schedules:
- `one`: the engine's order, every row on one stream;
- `lockstep`: two halves on two streams, no order between them (change 32);
- `staggered`: two halves on two streams, their attention kernels alternating (A's of layer l, then B's, then A's
  of layer l + 1, ordered by events), so that while one half's attention streams the cache the other half runs
  its o-projection, MLP and next QKV projection;
with the paged decode kernel launched as the engine does (`one` also without PDL). The first runs
(benchmarks/NOTES.md change 35, results in `results/h200_2026-12-03h/`) also tried it persistent, G programs taking
the items from a counter so that it holds fewer SMs (commit 9c7fcb7; removed: slower). Prints milliseconds per step
(median of replays) and writes JSON.

  python benchmarks/probe_overlap.py --out benchmarks/results/overlap_probe.json    # on the GPU
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# benchmarks/ is on the path when run as a script; the batch, its tables and the attention's shape are the sweep's
from sweep_paged_decode import HKV, LAYERS, MAX_MODEL_LEN, PAGE, D, H, inputs

from bench import save_json
from minivllm.layers.activation import silu_and_mul_triton
from minivllm.layers.attention_prologue import attention_prologue
from minivllm.layers.layernorm import rms_norm_triton
from minivllm.layers.paged_decode import paged_decode
from minivllm.testing.benchmark import COPY_BW, graph_replay_us
from minivllm.utils.switches import SWITCHES

HEADS, KV_HEADS, HEAD_DIM = H, HKV, D
HIDDEN, INTER = 1024, 3072  # Qwen3-0.6B's
EPS = 1e-6
PHASES = [(256, 100, 1500), (192, 200, 1700), (128, 300, 1800), (96, 400, 1900), (64, 500, 2000)]  # B, ctx lo, hi
PHASES += [(32, 700, 2000), (8, 1200, 2048)]


class Step:
    """One decode step's tensors: weights and KV caches of 28 layers, one batch's inputs."""

    def __init__(self, batch: int, lo: int, hi: int) -> None:
        dev, bf = "cuda", torch.bfloat16
        _, k, v, self.lens, tables = inputs(batch, lo, hi, longest_first=False)  # sweep_paged_decode.py's batch
        pad = tables[:, :1].expand(batch, MAX_MODEL_LEN // PAGE - tables.shape[1])  # a decode graph's width
        self.tables = torch.cat([tables, pad], dim=1).contiguous()
        pos = self.lens.long() - 1  # the new token's position
        self.positions = pos
        self.slots = self.tables[torch.arange(batch, device=dev), pos // PAGE].long() * PAGE + pos % PAGE
        self.batch = batch
        self.kv = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(LAYERS - 1)]
        self.kv_bytes = 2 * int(self.lens.sum()) * KV_HEADS * HEAD_DIM * 2 * LAYERS

        def w(n, k):
            return [torch.randn(n, k, device=dev, dtype=bf) / k**0.5 for _ in range(LAYERS)]

        qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.w_qkv, self.w_o = w(qkv, HIDDEN), w(HIDDEN, HEADS * HEAD_DIM)
        self.w_gu, self.w_down = w(2 * INTER, HIDDEN), w(HIDDEN, INTER)
        self.norm_w = torch.ones(HIDDEN, device=dev, dtype=bf)
        self.qk_w = torch.ones(HEAD_DIM, device=dev, dtype=bf)
        ang = torch.rand(4096, 1, HEAD_DIM // 2, device=dev) * 6.28
        self.cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1).contiguous()  # (max_pos, 1, D) fp32
        self.x = torch.randn(batch, HIDDEN, device=dev, dtype=bf)


class Half:
    """Rows [a, b) of a step, run layer by layer: pre (norm, QKV, prologue), attn, post (o, norm, MLP)."""

    def __init__(self, step: Step, a: int, b: int) -> None:
        self.s, self.a, self.b = step, a, b

    def start(self) -> None:
        self.h, self.res = self.s.x[self.a : self.b], None

    def pre(self, layer: int) -> None:
        s, a, b = self.s, self.a, self.b
        if self.res is None:
            x, self.res = rms_norm_triton(self.h, s.norm_w, EPS), self.h
        else:
            x, self.res = rms_norm_triton(self.h, s.norm_w, EPS, self.res)
        qkv = F.linear(x, s.w_qkv[layer])
        k_cache, v_cache = s.kv[layer]
        self.q, _, _ = attention_prologue(
            qkv,
            s.positions[a:b],
            s.cos_sin,
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            q_weight=s.qk_w,
            k_weight=s.qk_w,
            eps=EPS,
            k_cache=k_cache,
            v_cache=v_cache,
            slot_mapping=s.slots[a:b],
        )

    def attn(self, layer: int) -> None:
        s, a, b = self.s, self.a, self.b
        k_cache, v_cache = s.kv[layer]
        self.o = paged_decode(self.q, k_cache, v_cache, s.lens[a:b], s.tables[a:b], HEAD_DIM**-0.5)

    def post(self, layer: int) -> None:
        s = self.s
        h = F.linear(self.o.flatten(1), s.w_o[layer])
        x, self.res = rms_norm_triton(h, s.norm_w, EPS, self.res)
        self.h = F.linear(silu_and_mul_triton(F.linear(x, s.w_gu[layer])), s.w_down[layer])


def one(step: Step) -> None:
    half = Half(step, 0, step.batch)
    half.start()
    for layer in range(LAYERS):
        half.pre(layer)
        half.attn(layer)
        half.post(layer)


def halves(step: Step, side: torch.cuda.Stream, staggered: bool) -> None:
    """Half A on the current stream, half B on `side`; with `staggered`, B's attention of layer l waits for A's,
    and A's of layer l + 1 for B's of layer l (events), so the two attention kernels never run together."""
    main = torch.cuda.current_stream()
    h = step.batch // 2
    a, b = Half(step, 0, h), Half(step, h, step.batch)
    side.wait_stream(main)
    a.start()
    b.start()
    last_b_attn = None
    for layer in range(LAYERS):
        with torch.cuda.stream(main):
            a.pre(layer)
            if staggered and last_b_attn is not None:
                main.wait_event(last_b_attn)
            a.attn(layer)
            a_attn = torch.cuda.Event()
            a_attn.record(main)
            a.post(layer)
        with torch.cuda.stream(side):
            b.pre(layer)
            if staggered:
                side.wait_event(a_attn)
            b.attn(layer)
            last_b_attn = torch.cuda.Event()
            last_b_attn.record(side)
            b.post(layer)
    main.wait_stream(side)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="overlap_probe.json")
    ap.add_argument("--phases", type=int, default=len(PHASES), help="how many of PHASES to run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_overlap.py times CUDA graphs on a GPU; none here")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    side = torch.cuda.Stream()
    rows = []
    for batch, lo, hi in PHASES[: args.phases]:
        step = Step(batch, lo, hi)
        times = {}
        variants = [("one", True), ("one", False), ("lockstep", False), ("staggered", False)]
        for schedule, use_pdl in variants:
            SWITCHES.pdl = use_pdl  # the engine's launches (PDL), and all without PDL for the two streams
            label = f"{schedule}" + ("/pdl" if use_pdl else "")
            if schedule == "one":
                fn = lambda step=step: one(step)
            else:
                fn = lambda step=step, st=schedule == "staggered": halves(step, side, st)
            times[label] = graph_replay_us(fn) / 1e3
            print(f"B={batch:3d} ctx {lo}-{hi}: {label:22s} {times[label]:.3f} ms", flush=True)
        SWITCHES.pdl = True
        base = times["one/pdl"]
        best = min(times, key=times.get)
        floor_ms = step.kv_bytes / COPY_BW * 1e3
        rows.append(dict(batch=batch, ctx=[lo, hi], kv_floor_ms=round(floor_ms, 3), engine_ms=round(base, 3),
                         best=best, best_ms=round(times[best], 3),
                         all_ms={k: round(v, 3) for k, v in times.items()}))  # fmt: skip
        print(f"  engine {base:.3f} ms, best {best} {times[best]:.3f} ms (KV alone {floor_ms:.3f} ms)", flush=True)
        del step
        torch.cuda.empty_cache()
    save_json(dict(rows=rows, sms=sms), args.out)


if __name__ == "__main__":
    main()
