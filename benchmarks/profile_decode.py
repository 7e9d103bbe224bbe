"""Profile decode steps of the bench model on a GPU: the GPU time of one captured decode graph (a whole step)
at several batch sizes against its bandwidth floor, and with --kernels which kernels take the time in real
steps (torch.profiler; its per-kernel times run high). Writes a text report to --out."""

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers
import torch
from torch.profiler import ProfilerActivity, profile

from helpers.benchmark import COPY_BW, model_bytes_and_flops
from helpers.tiny_model import QWEN3_0_6B, make_tiny_checkpoint
from minivllm import LLM, SamplingParams, kernels
from minivllm.kernels import attention_backends


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="profile.txt")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--kernels", action="store_true", help="also a torch.profiler kernel table of real steps")
    ap.add_argument(
        "--variants",
        default="",
        help="also replay times per switch setting, re-capturing the graphs: e.g. 'pdl=0;pdl=1'",
    )
    ap.add_argument(
        "--replay-kernels",
        action="store_true",
        help="also the kernels of one graph replay (torch.profiler): time per kernel kind, busy vs wall",
    )
    args = ap.parse_args()
    path = make_tiny_checkpoint(
        os.path.expanduser("~/.cache/minivllm/qwen3-0.6b-random"), "qwen3", dtype=torch.bfloat16, **QWEN3_0_6B
    )
    llm = LLM(path, max_model_len=4096)
    runner = llm.model_runner
    lines = []

    def set_inputs(bs: int, ctx: int) -> None:
        """Fill the decode graphs' input buffer (its one layout, engine/step_inputs.py DecodeLayout)."""
        v, page = runner.buffers.decode, runner.block_size
        nblk = (ctx + page - 1) // page
        v["context_lens"][:bs] = ctx
        blocks = torch.arange(bs * nblk, device="cuda", dtype=torch.int32).view(bs, nblk)
        v["block_tables"][:bs, :nblk] = blocks % runner.config.num_kvcache_blocks
        v["slot_mapping"][:bs] = torch.arange(bs, device="cuda", dtype=torch.int32) * page * nblk + ctx - 1

    def replay_ms(bs: int, ctx: int, reps: int = 20) -> float:
        """Milliseconds per replay of the decode graph for `bs` sequences at context `ctx`, after a warm-up."""
        g = runner.graphs.graphs[runner.graphs.padded(bs)]
        set_inputs(bs, ctx)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps * 1e3

    # GPU time of one decode graph replay (the whole step: feeding, model, LM head, sampler) per batch size,
    # at context 1 (the fixed cost of a step) and at `context` tokens (KV reads on top)
    kv_bytes, weight_bytes, _ = model_bytes_and_flops(runner.config.hf_config)  # per token of context; weights
    for ctx in (1, args.context):
        for bs in (1, 8, 16, 32, 64, 128, 256):
            floor = (weight_bytes + bs * ctx * kv_bytes) / COPY_BW
            lines.append(
                f"batch {bs:4d} ctx {ctx:5d}: graph replay {replay_ms(bs, ctx):.3f} ms, floor {floor * 1e3:.3f} ms"
            )
            print(lines[-1], flush=True)
    for variant in filter(None, args.variants.split(";")):
        opts = dict(kv.split("=") for kv in variant.split(","))
        parse = lambda v: {"0": False, "1": True, "auto": None}.get(v, v)  # flags 0/1, compile auto, names as is
        options = replace(runner.config.kernels, **{name: parse(value) for name, value in opts.items()})
        name = runner.backend.name
        runner.ops = kernels.pick(runner.device, runner.dtype, backend=name, options=options)
        runner.backend = attention_backends.create(name, decode=runner.ops.paged_decode)
        runner.sampler.draw = runner.ops.draw
        runner.graphs = None
        torch.cuda.synchronize()
        runner.load_model()  # the model built again with this variant's kernels (bound at construction)
        runner.bind_kv_cache(runner.kv_cache)
        runner.capture_cudagraph()
        for ctx in (1, args.context):
            row = [f"b{bs} {replay_ms(bs, ctx):.3f}" for bs in (1, 8, 16, 32, 64, 128, 256)]
            lines.append(f"[{variant}] ctx {ctx}: " + "  ".join(row) + " (ms per replay)")
            print(lines[-1], flush=True)
    if args.replay_kernels:
        for bs, ctx in ((8, 600), (64, 600), (256, 1), (256, 600)):
            g = runner.graphs.graphs[runner.graphs.padded(bs)]
            set_inputs(bs, ctx)
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            n = 10
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                for _ in range(n):
                    g.replay()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t) / n
            kern = {}
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    c, us = kern.get(e.name, (0, 0.0))
                    kern[e.name] = (c + 1, us + e.time_range.elapsed_us())
            busy = sum(us for _, us in kern.values()) / n
            count = sum(c for c, _ in kern.values()) / n
            lines.append(
                f"--- batch {bs} ctx {ctx}: wall per replay (profiled) {wall * 1e6:.0f} us, "
                f"kernel busy {busy:.0f} us over {count:.0f} kernels"
            )
            for name, (c, us) in sorted(kern.items(), key=lambda kv: -kv[1][1])[:16]:
                lines.append(f"  {us / n:8.1f} us  {c / n:5.0f} x {us / c:6.2f} us  {name[:90]}")
            print("\n".join(lines[-17:]), flush=True)
    if not args.kernels:
        with open(args.out, "w") as f:
            f.write("\n".join(lines))
        return
    # kernel table over real decode steps of a batch
    prompts = [[(13 * i + j) % 10000 for j in range(args.context)] for i in range(args.batch)]
    sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=40)
    llm.generate(prompts[:8], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=4), use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, sp, use_tqdm=False)
    lines.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    log = llm.step_log[-40:]
    lines.append("steps: " + " ".join(f"{r.num_seqs}:{(r.run + r.postprocess) * 1e3:.1f}" for r in log))
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
