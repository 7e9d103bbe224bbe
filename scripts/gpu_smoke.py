"""GPU smoke check (one GPU): every attention backend and CUDA graphs on
vs off give the same greedy tokens, on a tiny Qwen3 (fp32) and a random Qwen3-0.6B-shaped model (bf16),
against a reference with torch attention and no programmatic dependent launch."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers
import torch

from helpers.tiny_model import QWEN3_0_6B, make_tiny_checkpoint
from minivllm import LLM, SamplingParams
from minivllm.kernels import attention_backends


def greedy(path, prompts, n, **kw):
    llm = LLM(path, **kw)
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    backend = llm.model_runner.backend.name
    llm.exit()
    return backend, [o.token_ids for o in out]


def main() -> int:
    cache = os.path.expanduser("~/.cache/minivllm")
    print("backends available:", attention_backends.available("cuda"))
    ok = True
    for name, path, dtype, n in [
        ("tiny-qwen3 fp32", make_tiny_checkpoint(f"{cache}/tiny-qwen3-smoke", "qwen3"), "float32", 48),
        (
            "qwen3-0.6b-random bf16",
            make_tiny_checkpoint(f"{cache}/qwen3-0.6b-random", "qwen3", dtype=torch.bfloat16, **QWEN3_0_6B),
            "bfloat16",
            32,
        ),
    ]:
        prompts = [[(7 * i + L) % 500 for i in range(L)] for L in (5, 300, 1, 700)]
        _, ref = greedy(
            path,
            prompts,
            n,
            attention_backend="torch",
            enforce_eager=True,
            dtype=dtype,
            max_model_len=2048,
            max_num_seqs=64,
            kernels=dict(pdl=False),
        )
        runs = {}
        for backend in attention_backends.available("cuda", getattr(torch, dtype)):
            for eager in (True, False):
                t = time.perf_counter()
                _, toks = greedy(
                    path,
                    prompts,
                    n,
                    attention_backend=backend,
                    enforce_eager=eager,
                    dtype=dtype,
                    max_model_len=2048,
                    max_num_seqs=64,
                )
                runs[(backend, eager)] = toks
                print(
                    f"{name}: backend={backend} eager={eager} ({time.perf_counter() - t:.1f}s) "
                    f"first tokens {toks[1][:6]}"
                )
        for key, toks in runs.items():
            agree = [sum(a == b for a, b in zip(x, y)) / len(y) for x, y in zip(toks, ref)]
            same = all(x == y for x, y in zip(toks, ref))
            print(
                f"  {name} {key} vs the plain reference: identical={same} "
                f"per-prompt agreement={[round(a, 2) for a in agree]}"
            )
            ok &= same or dtype == "bfloat16"
    print("SMOKE", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
