"""Profile decode steps of the bench model on a GPU: the GPU time of one captured decode graph (a whole step)
at several batch sizes against its bandwidth floor, and with --kernels which kernels take the time in real
steps (torch.profiler; its per-kernel times run high). Writes a text report to --out."""
import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import COPY_BW, model_bytes_and_flops  # noqa: E402  (the repo root's bench.py: the roofline's numbers)
from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.utils.tiny_model import QWEN3_0_6B, make_tiny_checkpoint  # noqa: E402


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="profile.txt")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--kernels", action="store_true", help="also a torch.profiler kernel table of real steps")
    args = ap.parse_args()
    path = make_tiny_checkpoint(os.path.expanduser("~/.cache/minivllm/qwen3-0.6b-random"), "qwen3",
                                dtype=torch.bfloat16, **QWEN3_0_6B)
    llm = LLM(path, max_model_len=4096)
    runner = llm.model_runner
    lines = []
    # GPU time of one decode graph replay (the whole step: feeding, model, LM head, sampler) per batch size,
    # at context 1 (the fixed cost of a step) and at `context` tokens (KV reads on top)
    kv_bytes, weight_bytes, _ = model_bytes_and_flops(runner.config.hf_config)   # per token of context; weights
    for ctx in (1, args.context):
        for bs in (1, 8, 16, 32, 64, 128, 256):
            g = runner.graphs[runner.graph_batch_size(bs)]
            v = runner.graph_vars
            nblk = (ctx + 255) // 256
            v["context_lens"][:bs] = ctx
            v["block_tables"][:bs, :nblk] = torch.arange(bs * nblk, device="cuda", dtype=torch.int32).view(bs, nblk) % runner.config.num_kvcache_blocks
            v["slot_mapping"][:bs] = torch.arange(bs, device="cuda", dtype=torch.int32) * 256 * nblk + ctx - 1
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) / 20
            floor = (weight_bytes + bs * ctx * kv_bytes) / COPY_BW
            lines.append(f"batch {bs:4d} ctx {ctx:5d}: graph replay {dt * 1e3:.3f} ms, floor {floor * 1e3:.3f} ms")
            print(lines[-1], flush=True)
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
