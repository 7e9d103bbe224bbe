"""Profile decode steps of the bench model on a GPU: which kernels take the time (torch.profiler), and the
GPU time of one captured decode graph at several batch sizes. Writes a text report to --out."""
import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minivllm import LLM, SamplingParams
from minivllm.utils.tiny_model import QWEN3_0_6B, make_tiny_checkpoint


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="profile.txt")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=600)
    args = ap.parse_args()
    path = make_tiny_checkpoint(os.path.expanduser("~/.cache/minivllm/qwen3-0.6b-random"), "qwen3",
                                dtype=torch.bfloat16, **QWEN3_0_6B)
    llm = LLM(path, max_model_len=4096)
    runner = llm.model_runner
    lines = []
    # GPU time of a graph replay alone, per batch size (inputs: valid slots, `context` tokens each)
    for bs in (1, 16, 64, 128, 256):
        g = runner.graphs[runner.graph_batch_size(bs)]
        v = runner.graph_vars
        nblk = (args.context + 255) // 256
        v["context_lens"][:bs] = args.context
        v["block_tables"][:bs, :nblk] = torch.arange(bs * nblk, device="cuda", dtype=torch.int32).view(bs, nblk) % runner.config.num_kvcache_blocks
        v["slot_mapping"][:bs] = torch.arange(bs, device="cuda", dtype=torch.int32) * 256 * nblk + args.context - 1
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / 20
        logits = llm.model_runner.model.compute_logits(runner.graph_outputs[:bs])
        temps = torch.full((bs,), 0.6, device="cuda")
        for _ in range(3):
            runner.sampler(logits, temps)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            runner.sampler(llm.model_runner.model.compute_logits(runner.graph_outputs[:bs]), temps)
        torch.cuda.synchronize()
        ds = (time.perf_counter() - t) / 20
        lines.append(f"batch {bs:4d} ctx {args.context}: graph replay {dt * 1e3:.3f} ms, lm_head+sampler {ds * 1e3:.3f} ms")
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
