"""Greedy tokens of the tiny test models under several engine settings (default; a small KV cache that forces
preemption and chunked prefill, with prompts sharing a prefix; TP=2 over gloo), and of the embedded SmolLM2 (the
default settings, its chat prompts), written to JSON, so that two versions of the code can be compared token for
token (a refactoring must not change any). On a GPU (--device cuda) the models run in bfloat16 with CUDA graphs;
TP=2 then needs two GPUs.

  python3 scripts/greedy_tokens.py before.json          # in one checkout
  python3 scripts/greedy_tokens.py after.json           # in the other
  python3 scripts/greedy_tokens.py --compare before.json after.json

The models are made here with a fixed seed (helpers.tiny_model), in a temporary directory."""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers
import torch

from helpers.tiny_model import TINY_LLAMA, make_tiny_checkpoint
from minivllm import LLM, SamplingParams
from minivllm.frontend.default_model import default_model_dir

SETTINGS = {
    "default": dict(),
    "pressure": dict(num_kvcache_blocks=16, kvcache_block_size=16, max_num_batched_tokens=64, max_model_len=512),
    "tp2": dict(tensor_parallel_size=2, kvcache_block_size=16),
}


def dump(out: str, device: str = "cpu") -> None:
    root = tempfile.mkdtemp(prefix="greedy-tokens-")
    models = {
        "qwen3": make_tiny_checkpoint(f"{root}/qwen3", "qwen3"),
        "qwen2": make_tiny_checkpoint(f"{root}/qwen2", "qwen2"),
        "llama": make_tiny_checkpoint(f"{root}/llama", "llama", **TINY_LLAMA),
        "smollm2": default_model_dir(),
    }
    dtype = "float32" if device == "cpu" else "bfloat16"
    chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name three colors.")]
    prompts = [[(7 * i + n) % 500 + 1 for i in range(n)] for n in (1, 5, 17, 40, 90, 200)]
    prompts.append(prompts[4][:60] + [3, 4, 5])  # shares a prefix with prompt 4
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    result = {}
    for arch, path in models.items():
        for name, kwargs in SETTINGS.items():
            if (name == "tp2" and arch != "qwen3") or (arch == "smollm2" and name != "default"):
                continue
            if name == "tp2" and device == "cuda" and torch.cuda.device_count() < 2:
                print("tp2 skipped: one GPU")
                continue
            llm = LLM(path, device=device, dtype=dtype, **kwargs)
            outputs = llm.generate(prompts, greedy, use_tqdm=False)
            if arch == "smollm2":
                outputs += llm.chat(chats, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
            result[f"{arch}/{name}"] = [o.token_ids for o in outputs]
            result[f"{arch}/{name}/preemptions"] = llm.scheduler.num_preemptions
            llm.exit()
    with open(out, "w") as fh:
        json.dump(result, fh)
    print(f"wrote {out}: {len(result)} entries")


def compare(a: str, b: str) -> int:
    with open(a) as fa, open(b) as fb:
        x, y = json.load(fa), json.load(fb)
    differ = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
    print(f"{len(x.keys() & y.keys())} entries compared; differ: {differ or 'none'}")
    return 1 if differ else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="JSON to write")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    sys.exit(compare(*args.compare) if args.compare else dump(args.out, args.device))
