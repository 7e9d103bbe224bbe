"""The CPU serving preset's ceiling by thread count: offline `LLM.generate` output tok/s of the preset's tiny Qwen3
on its 128-stream level (256 requests, 64 in / 64 out, greedy, ignore_eos), all at once and with at most 128 at once
(`max_num_seqs`: what a server of no cost could deliver to 128 streams), for each torch intra-op thread count. The
preset's target compares the served figure with the all-at-once one, so `capped / all` is the most a server can
keep on that host. Each cell is measured as bench_serve.py measures its offline columns (`offline_throughputs`: a
fresh engine, the whole level once as the warm-up, a cold prefix cache each run), best of two runs.

  python3 benchmarks/cpu_threads.py                       # the host's thread counts: its default, 16, 12, 8, 6, 4, 2, 1
  python3 benchmarks/cpu_threads.py --threads 2 1         # only these

Prints a table, writes JSON (default benchmarks/results/cpu_threads.json)."""

import argparse
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers
from helpers.benchmark import save_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="torch thread counts to measure")
    ap.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "minivllm"))
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "cpu_threads.json"))
    args = ap.parse_args()
    import bench_serve  # (beside this script) its checkpoint and offline measure: the columns this is the ceiling of

    default = torch.get_num_threads()
    counts = args.threads or sorted({default, 16, 12, 8, 6, 4, 2, 1} & set(range(1, (os.cpu_count() or 1) + 1)))[::-1]
    model = bench_serve.model_dir(bench_serve.TINY_QWEN3, args.cache)
    rng = random.Random(0)
    prompts = [[rng.randint(1, 500) for _ in range(64)] for _ in range(256)]
    rows = []
    for n in counts:
        torch.set_num_threads(n)
        row = dict(threads=n)
        for name, cap in (("all", None), ("capped", 128)):  # best of two runs, the whole level as the warm-up
            row[name] = max(bench_serve.offline_throughputs(model, [], [prompts, prompts], prompts, 64, cap))
        row["capped_over_all"] = row["capped"] / row["all"]
        rows.append(row)
        print(f"{n:3d} threads: all at once {row['all']:8.0f}  <= 128 at once {row['capped']:8.0f}  "
              f"ratio {row['capped_over_all']:.2f}", flush=True)  # fmt: skip
    save_json(dict(default_threads=default, cores=os.cpu_count(), rows=rows), args.out)


if __name__ == "__main__":
    main()
