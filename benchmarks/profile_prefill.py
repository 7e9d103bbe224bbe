"""Profile the prefill steps of bench.py's workload on a GPU: each step's wall time against its matmul floor, and
which kernels take the time (torch.profiler), in two forms: the workload's first steps as they run (prefill
chunks that carry the decode rows of sequences already running), and the same prompts with max_tokens=1 (prefill
alone). With --cprofile, the host's Python profile of the workload's first steps too; with --gc, the Python
garbage collector's pauses in those steps, and the same steps after gc.freeze(). Writes a text report to --out.

  python benchmarks/profile_prefill.py --out prefill_profile.txt
"""

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers
import torch
from torch.profiler import ProfilerActivity, profile

from helpers.benchmark import MATMUL_FLOPS, model_bytes_and_flops, workload
from helpers.tiny_model import QWEN3_0_6B, make_tiny_checkpoint
from minivllm import LLM, SamplingParams


def kernel_table(prof, top: int = 18) -> list[str]:
    kern: dict[str, tuple[int, float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            c, us = kern.get(e.name, (0, 0.0))
            kern[e.name] = (c + 1, us + e.time_range.elapsed_us())
    busy = sum(us for _, us in kern.values())
    lines = [f"  kernel busy {busy / 1e3:.1f} ms over {sum(c for c, _ in kern.values())} kernels"]
    for name, (c, us) in sorted(kern.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {us / 1e3:8.2f} ms  {c:6d} x {us / c:7.1f} us  {name[:90]}")
    return lines


def step_lines(llm: LLM, start: int, params: int) -> list[str]:
    """One line per step: kind, sequences, tokens, wall ms (launch to tokens back), its matmul floor."""
    lines = []
    for r in llm.step_log.since(start):
        floor_ms = 2 * params * r.num_tokens / MATMUL_FLOPS * 1e3
        ms = (r.schedule + r.run + r.postprocess) * 1e3
        kind = "prefill" if r.is_prefill else "decode"
        lines.append(
            f"  {kind:7s} seqs {r.num_seqs:4d} tokens {r.num_tokens:6d}: {ms:7.2f} ms (floor {floor_ms:.2f}; host "
            f"schedule {r.schedule * 1e3:.2f}, launch {r.run * 1e3:.2f}, postprocess {r.postprocess * 1e3:.2f})"
        )
    return lines


ACTIVITY = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU  # CPU: a dry run


def sync() -> None:
    if torch.cuda.is_available():  # (a dry run on CPU has nothing to wait for)
        torch.cuda.synchronize()


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="prefill_profile.txt")
    ap.add_argument("--steps", type=int, default=12, help="steps of the workload to profile as it runs")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--cprofile", action="store_true", help="also cProfile the host over the workload's first steps")
    ap.add_argument("--gc", action="store_true", help="also the garbage collector's pauses, then with gc.freeze()")
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: bench.py's random Qwen3-0.6B)")
    args = ap.parse_args()
    path = args.model or make_tiny_checkpoint(
        os.path.expanduser("~/.cache/minivllm/qwen3-0.6b-random"), "qwen3", dtype=torch.bfloat16, **QWEN3_0_6B
    )
    llm = LLM(path, max_model_len=4096)
    _, _, params = model_bytes_and_flops(llm.config.hf_config)
    params -= llm.config.hf_config.vocab_size * llm.config.hf_config.hidden_size  # the LM head: last tokens only
    prompts, sampling = workload(0, args.num_seqs, 100, 1024, 1024)
    lines, printed = [], 0

    # prefill alone: every prompt with max_tokens=1 (a warm-up pass, then a profiled one)
    one = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)
    llm.generate(prompts, one, use_tqdm=False)
    for profiled in (False, True):
        llm.reset_prefix_cache()
        start = llm.step_log.mark()
        with profile(activities=[ACTIVITY]) if profiled else nullcontext() as prof:
            llm.generate(prompts, one, use_tqdm=False)
            sync()
        lines.append(f"--- prefill alone ({'profiled' if profiled else 'plain'}):")
        lines += step_lines(llm, start, params)
        if profiled:
            lines += kernel_table(prof)
        print("\n".join(lines[printed:]), flush=True)
        printed = len(lines)

    # the workload as it runs: its first steps (prefill chunks with the running sequences' decode rows), twice
    modes = [False, True] + ["cprofile"] * args.cprofile + ["gc", "gc-frozen"] * args.gc
    pauses: list[tuple[int, float]] = []  # (generation, seconds) of each collection in the mode that runs
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((info["generation"], time.perf_counter() - started.pop()))

    if args.gc:
        gc.callbacks.append(on_gc)  # for both gc modes; each mode starts from an empty list
    for profiled in modes:
        if profiled == "gc-frozen":
            gc.collect()
            gc.freeze()  # what the engine had made so far: never scanned again
        pauses.clear()
        llm.reset_prefix_cache()
        ids = [f"w{profiled}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, sampling):
            llm.add_request(rid, p, sp)
        start = llm.step_log.mark()
        host = cProfile.Profile() if profiled == "cprofile" else None
        with profile(activities=[ACTIVITY]) if profiled is True else host or nullcontext() as prof:
            for _ in range(args.steps):
                llm.step()
            sync()
        what = {False: "plain", True: "torch.profiler", "cprofile": "cProfile"}.get(profiled, profiled)
        lines.append(f"--- the workload's first {args.steps} steps ({what}):")
        lines += step_lines(llm, start, params)
        if profiled is True:
            lines += kernel_table(prof)
        if str(profiled).startswith("gc"):
            for g in (0, 1, 2):
                ms = [p * 1e3 for gen, p in pauses if gen == g]
                lines.append(
                    f"  gc generation {g}: {len(ms)} collections, {sum(ms):.1f} ms, longest {max(ms, default=0):.1f} ms"
                )
        if host is not None:
            text = io.StringIO()
            pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(40)
            lines += text.getvalue().splitlines()
        print("\n".join(lines[printed:]), flush=True)
        printed = len(lines)
        llm.abort_request(ids)
        while llm.has_unfinished_requests():
            llm.step()
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
