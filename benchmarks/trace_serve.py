"""bench_serve.py with the engine traced, to see where a served level's time goes beside offline `LLM.generate`'s.

    python3 benchmarks/trace_serve.py --trace-dir DIR -- --preset cpu --concurrency 128 --api-server-count 4

runs bench_serve.py with those arguments (its JSON to DIR/serve.json) in a child process whose every Python
process loads benchmarks/trace_hook/sitecustomize.py: each engine step of the engine core and of the offline runs
(start and end, CPU user / kernel seconds, page faults, involuntary context switches, the step launches it
completed with their tokens and launch seconds), each message the core receives, and each request the client sends
(its start, TTFT and latency). Then it prints, for the last level, each wave of `concurrency` requests (the
client's sends, their arrival at the core, first tokens, ends), the core's steps (busy time, CPU, faults, the median
decode step and the gap between steps, every prefill launch), and each offline run's steps; DIR/summary.json keeps
it. Use one level (one --concurrency value, one --api-server-count) per run."""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(argv: list[str]) -> None:
    """bench_serve.main() with each request's perf_counter start, TTFT and latency kept in TRACE_DIR/client.json."""
    import bench_serve  # (beside this script: the first entry of sys.path when it runs)

    timed, requests = bench_serve.timed_request, []

    async def recorded(*args, **kwargs):
        result = await timed(*args, **kwargs)
        requests.append([result["start"], result["ttft"], result["latency"]])
        return result

    bench_serve.timed_request = recorded
    sys.argv = ["bench_serve.py", *argv]
    try:
        bench_serve.main()
    finally:
        with open(os.path.join(os.environ["TRACE_DIR"], "client.json"), "w") as f:
            json.dump(requests, f)


def records(trace_dir: str, pattern: str) -> list[dict]:
    out = []
    for path in glob.glob(os.path.join(trace_dir, pattern)):
        with open(path) as f:
            out += [json.loads(line) for line in f]
    return out


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 2) if values else float("nan")


def is_decode(step: dict, min_seqs: int) -> bool:
    return bool(step["launches"]) and not any(p for p, *_ in step["launches"]) and step["launches"][0][1] >= min_seqs


def runs_of(steps: list[dict]) -> list[list[dict]]:
    """Steps split after each one that left the engine idle (one generate() call each, offline)."""
    runs: list[list[dict]] = [[]]
    for step in sorted(steps, key=lambda s: s["t0"]):
        runs[-1].append(step)
        if step["idle"]:
            runs.append([])
    return [run for run in runs if run]


def summarize(trace_dir: str) -> dict:
    with open(os.path.join(trace_dir, "serve.json")) as f:
        level = json.load(f)["levels"][-1]
    with open(os.path.join(trace_dir, "client.json")) as f:
        sent = sorted(json.load(f))[-level["completed"] - level["failed"] :]  # the last level's requests
    conc, start = level["concurrency"], sent[0][0]
    end = max(s + latency for s, _, latency in sent)
    core = records(trace_dir, "minivllm-core-*.jsonl")
    adds = sorted(r["t"] for r in core if r["kind"] == "msg" and r["type"] == "AddRequest" and r["t"] >= start)
    rel = lambda ts: [round(min(ts) - start, 4), round(max(ts) - start, 4)] if ts else None
    waves = []
    for i in range(0, len(sent), conc):
        wave = sent[i : i + conc]
        waves.append(
            dict(
                sends=rel([s for s, _, _ in wave]), core_adds=rel(adds[i : i + conc]),
                first_tokens=rel([s + ttft for s, ttft, _ in wave]), ends=rel([s + lat for s, _, lat in wave]),
            )
        )  # fmt: skip
    steps = [r for r in core if r["kind"] == "step" and start <= r["t0"] <= end]
    gaps = [b["t0"] - a["t1"] for a, b in zip(steps, steps[1:]) if b["t0"] - a["t1"] < 0.02]
    prefills = [[seqs, tokens, round(run * 1e3, 1)] for s in steps for p, seqs, tokens, run in s["launches"] if p]
    served = dict(
        requests=len(sent), seconds=round(end - start, 4), waves=waves, core_steps=len(steps),
        core_busy_s=round(sum(s["t1"] - s["t0"] for s in steps), 4),
        core_user_s=round(sum(s["user"] for s in steps), 3),
        core_sys_s=round(sum(s["sys"] for s in steps), 3), core_faults=sum(s["faults"] for s in steps),
        core_tokens=sum(t for s in steps for _, _, t, _ in s["launches"]),
        decode_step_ms=median_ms([s["t1"] - s["t0"] for s in steps if is_decode(s, conc // 2)]),
        gap_ms=median_ms(gaps), prefill_launches=prefills,
    )  # fmt: skip
    offline = []
    for run in runs_of([r for r in records(trace_dir, "python*-*.jsonl") if r["kind"] == "step"]):
        seqs = max((n for s in run for _, n, _, _ in s["launches"]), default=0)
        offline.append(
            dict(
                steps=len(run), seconds=round(run[-1]["t1"] - run[0]["t0"], 4), max_seqs=seqs,
                decode_step_ms=median_ms([s["t1"] - s["t0"] for s in run if is_decode(s, max(1, seqs // 2))]),
                faults=sum(s["faults"] for s in run), sys_s=round(sum(s["sys"] for s in run), 3),
            )
        )  # fmt: skip
    return dict(level={k: v for k, v in level.items() if not isinstance(v, list)}, served=served, offline=offline)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace-dir", required=True)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    rest = [a for a in rest if a != "--"]
    if args.child:
        return child(rest)
    os.makedirs(args.trace_dir, exist_ok=True)
    env = dict(os.environ, TRACE_DIR=os.path.abspath(args.trace_dir))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "trace_hook"), env.get("PYTHONPATH")]))
    out = ["--out", os.path.join(args.trace_dir, "serve.json")]
    subprocess.run(
        [sys.executable, __file__, "--trace-dir", args.trace_dir, "--child", *rest, *out], env=env, check=True
    )
    summary = summarize(args.trace_dir)
    with open(os.path.join(args.trace_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    served = summary["served"]
    print(f"served: {served['requests']} requests in {served['seconds']} s")
    for i, wave in enumerate(served["waves"]):
        print(f"  wave {i}: " + ", ".join(f"{k} {v[0]:.3f}-{v[1]:.3f} s" for k, v in wave.items() if v))
    print(
        f"  core: {served['core_steps']} steps, busy {served['core_busy_s']} s, user {served['core_user_s']} s, kernel"
        f" {served['core_sys_s']} s, {served['core_faults']} page faults; decode step {served['decode_step_ms']} ms,"
        f" gap {served['gap_ms']} ms; prefill launches (seqs, tokens, ms) {served['prefill_launches']}"
    )
    for run in summary["offline"]:
        print(f"offline: {run}")


if __name__ == "__main__":
    main()
