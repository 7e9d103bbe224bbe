"""The README's first command against a plain transformers script, as a new user meets both (CPU).

Each pair runs, in fresh processes and alternating which goes first: `python3 -m minivllm "What is the capital
of France?"` (the embedded SmolLM2-135M-Instruct, converted once beforehand), and a script that loads the same
checkpoint with transformers, applies the same chat template and generates greedily, 32 new tokens at most.
Wall time of each process, start to exit. With --drop-caches (root) the OS's file cache is dropped before every
run, as on a machine that has just booted. Prints a table and writes JSON.

    python3 benchmarks/cli_vs_transformers.py [--pairs 5] [--drop-caches] [--out results/cli_cpu.json]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

PROMPT = "What is the capital of France?"

TRANSFORMERS_SCRIPT = """
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model_dir = sys.argv[1]
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
text = tok.apply_chat_template([{"role": "user", "content": sys.argv[2]}], add_generation_prompt=True, tokenize=False)
ids = tok(text, return_tensors="pt")
with torch.inference_mode():
    out = model.generate(**ids, do_sample=False, max_new_tokens=32)
print(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
"""


def timed(cmd: list[str], drop_caches: bool) -> tuple[float, str]:
    if drop_caches:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{out.stderr[-3000:]}")
    return seconds, out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--drop-caches", action="store_true", help="drop the OS's file cache before every run (root)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cli_cpu.json"))
    args = ap.parse_args()

    from minivllm.frontend.default_model import default_model_dir

    model = default_model_dir()  # converts the embedded model once, outside the timings
    engine = [sys.executable, "-m", "minivllm", PROMPT]
    reference = [sys.executable, "-c", TRANSFORMERS_SCRIPT, model, PROMPT]
    rows = []
    for i in range(args.pairs):
        order = [("minivllm", engine), ("transformers", reference)]
        if i % 2:
            order.reverse()
        pair = {}
        for name, cmd in order:
            pair[name], text = timed(cmd, args.drop_caches)
            pair[f"{name}_first"] = name == order[0][0]
        rows.append(pair)
        print(f"pair {i + 1}: minivllm {pair['minivllm']:.2f} s, transformers {pair['transformers']:.2f} s")
    engine_s = [r["minivllm"] for r in rows]
    hf_s = [r["transformers"] for r in rows]
    faster = sum(e < h for e, h in zip(engine_s, hf_s))
    print(f"minivllm     median {statistics.median(engine_s):.2f} s  ({min(engine_s):.2f}-{max(engine_s):.2f})")
    print(f"transformers median {statistics.median(hf_s):.2f} s  ({min(hf_s):.2f}-{max(hf_s):.2f})")
    print(f"minivllm faster in {faster} of {len(rows)} pairs")
    result = dict(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        machine=dict(cpus=os.cpu_count(), platform=platform.platform()),
        prompt=PROMPT,
        drop_caches=args.drop_caches,
        pairs=rows,
        minivllm_median_s=statistics.median(engine_s),
        transformers_median_s=statistics.median(hf_s),
        minivllm_faster_pairs=faster,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
