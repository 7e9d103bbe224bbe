"""Where the host's time goes in the first steps of bench.py's workload on a GPU (the prefill steps, which carry
the decode rows of the sequences already running): per step, the wall time of `LLMEngine.step()` and the host
seconds inside the model runner's calls (input preparation, the model's forward as launched, FlashAttention-4's
calls, the decode kernel's calls, sampling), with the caching allocator's new segments and retries. Three passes
over the same prompts in one process: the first shows what a process's first workload pays. The timers wrap the
functions in place (this script's process only).

  python benchmarks/profile_prefill_host.py > prefill_host.txt
"""

import os
import time
from collections import defaultdict

import torch

from minivllm import LLM
from minivllm.engine import model_runner
from minivllm.layers import attention_backend
from minivllm.testing.benchmark import workload
from minivllm.testing.tiny_model import QWEN3_0_6B, make_tiny_checkpoint

seconds: dict[str, float] = defaultdict(float)  # host seconds per wrapped call, this step


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - t

    return wrapper


def main() -> None:
    attention_backend.prefill_paged = timed("fa4", attention_backend.prefill_paged)
    attention_backend.decode = timed("decode", attention_backend.decode)
    runner = model_runner.ModelRunner
    for name, attr in (("prepare", "prepare_prefill"), ("prep_sample", "prepare_sample"), ("sample", "sample")):
        setattr(runner, attr, timed(name, getattr(runner, attr)))
    runner.run_model = timed("run_model", runner.run_model)
    model_runner.StepHandle.__init__ = timed("handle", model_runner.StepHandle.__init__)
    path = make_tiny_checkpoint(
        os.path.expanduser("~/.cache/minivllm/qwen3-0.6b-random"), "qwen3", dtype=torch.bfloat16, **QWEN3_0_6B
    )
    llm = LLM(path, max_model_len=4096)
    prompts, sampling = workload(0, 256, 100, 1024, 1024)
    for rep in range(3):
        llm.reset_prefix_cache()
        ids = [f"r{rep}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, sampling):
            llm.add_request(rid, p, sp)
        for s in range(11):
            seconds.clear()
            st = torch.cuda.memory_stats()
            seg0, retries0 = st["segment.all.allocated"], st["num_alloc_retries"]
            t = time.perf_counter()
            llm.step()
            wall = time.perf_counter() - t
            st = torch.cuda.memory_stats()
            calls = " ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(seconds.items()))
            alloc = f"segs +{st['segment.all.allocated'] - seg0} retries +{st['num_alloc_retries'] - retries0}"
            print(f"rep {rep} step {s}: wall {wall * 1e3:6.1f} | {calls} | {alloc}", flush=True)
        torch.cuda.synchronize()
        llm.abort_request(ids)
        while llm.has_unfinished_requests():
            llm.step()


if __name__ == "__main__":
    main()
