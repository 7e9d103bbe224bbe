"""Serving benchmark in the metrics `vllm bench serve` reports: request throughput, output tok/s, time to
first token (TTFT), time per output token after the first (TPOT) and inter-token latency (ITL), mean / p50 /
p99, over a sweep of fixed concurrencies and of request rates (Poisson arrivals). It starts `python3 -m
minivllm serve` in a subprocess, sends streaming /v1/completions requests of random token ids (vLLM's
"random" dataset: fixed input and output lengths, ignore_eos) with aiohttp, as `vllm bench serve` does,
waits after its warm-up until the server's processes are quiet (a slow host may still be starting some),
resets the prefix cache before each level, then stops the server and runs the same requests of every level
through the offline `LLM.generate` (the engine alone, same engine arguments): each level reports served output
tok/s, offline tok/s and their ratio (what the serving layer keeps of the engine's speed); on the CPU also the
offline tok/s with at most the level's concurrency of requests at once (`max_num_seqs`), the most a server of no
cost could deliver at that level. Each level also reports the CPU time per output token of the engine (the core
process, its TP workers; apart, how much of it was in the kernel: page faults, system calls), of the API server
(with its tokenizer workers) and of this client: where serving's cost goes (the API server: every API-server process
and its tokenizer workers, summed). With `--api-server-count 1 4` the sweep runs once per count of API-server
processes (`minivllm serve --api-server-count`), on the same requests. On the CPU it first builds this machine's C++
operators where they are missing, as scripts/setup.sh does, and records which operators the engine ran.
Prints a table, writes JSON (and, with --figure, TTFT and TPOT against concurrency).

  python3 benchmarks/bench_serve.py                                  # CPU: the embedded SmolLM2-135M-Instruct
  python3 benchmarks/bench_serve.py --preset cpu                     # CPU: a tiny Qwen3, up to 128 streams
  python3 benchmarks/bench_serve.py --model random-qwen3-0.6b        # GPU: bench.py's random Qwen3-0.6B (bf16)
  python3 benchmarks/bench_serve.py --model random-qwen3-0.6b --request-rate 50 100 200   # + Poisson at 256
  python3 benchmarks/bench_serve.py --model random-qwen3-0.6b --request-rate 200 --api-server-count 1 4

Targets: on the CPU preset served >= 0.7x offline at 128 streams; on an H200 (random Qwen3-0.6B, 512 in / 128
out) >= 0.8x at 256 streams, and no concurrency level below the one before it up to 256.

TTFT counts from sending the request to the first streamed chunk; TPOT = (latency - TTFT) / (tokens - 1) per
request; ITL = the gaps between streamed chunks (one chunk per engine step with new tokens, as vLLM streams). The
JSON keeps each request's send time and TTFT (`sent_s_ttft_ms`), to see where a level's TTFT tail comes from; each
level also reports the share of its requests whose TTFT the server itself (/metrics, from arrival in an API
server) put within 0.5 s, and the longest this client's event loop could not run (client lag max). The client
runs each level with its garbage collector off (client_gc_paused): a full collection of its heap would stall it."""

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers
from helpers.benchmark import save_json
from minivllm.engine.tp_workers import TP_WORKER, free_port
from minivllm.serve.api_servers import API_SERVER
from minivllm.serve.core import CORE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANDOM_QWEN3 = "random-qwen3-0.6b"
TINY_QWEN3 = "tiny-qwen3"  # the CPU preset's model: small enough that the serving layer's cost shows
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def model_dir(name: str | None, cache: str) -> str | None:
    """The checkpoint to serve: None (the server's embedded default), bench.py's random Qwen3-0.6B, the CPU
    preset's tiny Qwen3, or a dir."""
    if name not in (RANDOM_QWEN3, TINY_QWEN3):
        return name
    import torch

    from helpers.tiny_model import QWEN3_0_6B, make_tiny_checkpoint

    if name == TINY_QWEN3:
        return make_tiny_checkpoint(os.path.join(cache, "qwen3-tiny-serve"), "qwen3", **TINY)

    return make_tiny_checkpoint(os.path.join(cache, "qwen3-0.6b-random"), "qwen3", dtype=torch.bfloat16, **QWEN3_0_6B)


def vocab_size(model: str | None) -> int:
    if model is None:  # the embedded default model
        from minivllm.frontend.default_model import default_model_dir

        model = default_model_dir()
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)["vocab_size"]


def start_server(
    model: str | None, port: int, server_args: list[str], log_level: str, log: str | None, server_env: dict
):
    """`python3 -m minivllm serve` in a subprocess (its output to `log`, else to ours; `server_env` added to its
    environment), once /health answers."""
    cmd = [sys.executable, "-m", "minivllm", "serve", "--port", str(port), "--log-level", log_level, *server_args]
    cmd += ["--model", model] if model else []
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONFAULTHANDLER": "1"}
    env.update(server_env)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache, before each level
    with open(log, "a") if log else contextlib.nullcontext() as out:  # the child keeps its own copy of the file
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
    deadline = time.time() + 900  # a GPU engine captures its graphs first
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}{server_log_tail(log)}")
        if time.time() > deadline:
            proc.kill()
            raise SystemExit("the server did not come up in 900 s")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)


def server_log_tail(log: str | None, lines: int = 30) -> str:
    if not log or not os.path.exists(log):
        return ""
    with open(log, errors="replace") as f:
        return "; the end of its log:\n" + "".join(f.readlines()[-lines:])


async def one_request(client: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    """One streaming completion; a failed one (an HTTP error, a connection the server closed) is returned with
    its error, and counted apart, as vLLM's benchmark counts failed requests."""
    try:
        return await timed_request(client, url, model, prompt, output_len)
    except (aiohttp.ClientError, RuntimeError, json.JSONDecodeError, KeyError) as e:
        return dict(error=f"{type(e).__name__}: {e}", input_tokens=len(prompt))


async def timed_request(
    client: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int
) -> dict:
    body = dict(
        model=model,
        prompt=prompt,
        max_tokens=output_len,
        temperature=0.0,
        ignore_eos=True,
        stream=True,
        stream_options=dict(include_usage=True),
    )
    start = time.perf_counter()
    times, tokens = [], 0
    async with client.post(url, json=body) as r:
        if r.status != 200:  # the server's error body names the problem: keep it
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:  # one line at a time
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:  # one chunk per engine step with new tokens (their text may be empty)
                times.append(time.perf_counter())
    end = time.perf_counter()
    ttft = times[0] - start if times else end - start
    return dict(
        start=start,
        ttft=ttft,
        latency=end - start,
        tpot=(end - start - ttft) / (tokens - 1) if tokens > 1 else 0.0,
        itl=list(np.diff(times)),
        output_tokens=tokens,
        input_tokens=len(prompt),
    )


@contextlib.contextmanager
def client_gc_paused():
    """No garbage collection in this client during a level: the heap so far (torch, the prompts, earlier
    levels) frozen out of the collector, the collector off, then a collection after the level. A full
    collection of that heap pauses the event loop ~0.1-0.3 s; during a level's first wave it holds back
    sends and reads, a TTFT tail that is the client's, not the server's (benchmark clients such as NVIDIA's
    AIPerf freeze and disable the collector for the same reason)."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()
        gc.collect()


async def loop_stalls(out: list[float], period: float = 0.005) -> None:
    """Appends how late each `period` sleep of this client's event loop woke (s): the client's own lag."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period)
        out.append(time.perf_counter() - t - period)


async def run_level(url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int, rate: float):
    """Send every prompt, at most `concurrency` in flight, arrivals Poisson at `rate` per second (inf: at once)."""
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(0)
    lags: list[float] = []
    monitor = asyncio.create_task(loop_stalls(lags))
    connector = aiohttp.TCPConnector(limit=0)  # no limit on connections: `concurrency` is the gate
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as client:

        async def limited(prompt):
            async with gate:
                return await one_request(client, url, model, prompt, output_len)

        tasks, start = [], time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    monitor.cancel()
    level = summarize(results, duration, concurrency, rate, start)
    level["client_loop_lag_max_ms"] = max(lags, default=0.0) * 1e3  # the longest the client could not read or send
    return level


TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds_bucket"


def ttft_buckets(url: str) -> dict[float, float]:
    """The server's own TTFT histogram (/metrics, every API server summed): cumulative count per bucket bound."""
    out: dict[float, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(TTFT_HISTOGRAM):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            out[bound] = out.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def share_within(before: dict[float, float], after: dict[float, float], bound: float) -> float:
    """The share of what a level added to a cumulative histogram that fell at or under `bound` (a bucket bound:
    exact, where a percentile read from buckets 0.25, 0.5, 0.75 s apart would be a guess)."""
    total = after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)
    return (after.get(bound, 0.0) - before.get(bound, 0.0)) / total if total > 0 else float("nan")


class CpuMeter:
    """CPU seconds spent so far by each side: the engine (the core process and its tensor-parallel workers, named
    minivllm-core and minivllm-tp<rank>), the API server (its process and its tokenizer workers) and this client.
    Read before and after a level, per output token: where serving's cost goes."""

    def __init__(self, server_pid: int) -> None:
        self.server = psutil.Process(server_pid)

    def read(self) -> dict[str, float]:
        out = dict(engine=0.0, engine_sys=0.0, api=0.0)  # engine_sys: the engine's share in the kernel (page faults)
        for p in [self.server, *self.server.children(recursive=True)]:
            try:
                t, name = p.cpu_times(), p.name()
            except psutil.NoSuchProcess:
                continue
            engine = name.startswith((CORE, TP_WORKER))
            out["engine" if engine else "api"] += t.user + t.system
            out["engine_sys"] += t.system if engine else 0.0
        r = resource.getrusage(resource.RUSAGE_SELF)
        out["client"] = r.ru_utime + r.ru_stime
        return out

    def wait_quiet(self, cores: float = 0.2, window: float = 0.5, timeout: float = 60.0) -> float:
        """Wait until the server's processes together use less than `cores` of CPU over `window` seconds (the
        first /health answer comes from whichever API-server process is ready first; the others, and their
        tokenizer workers, may still be loading). Returns the seconds waited."""
        start = time.monotonic()
        last = self.read()
        while time.monotonic() - start < timeout:
            time.sleep(window)
            now = self.read()
            if (now["engine"] + now["api"]) - (last["engine"] + last["api"]) < cores * window:
                break
            last = now
        return time.monotonic() - start

    @staticmethod
    def per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
        return {f"cpu_us_per_token_{k}": (after[k] - before[k]) / max(1, tokens) * 1e6 for k in before}


def check_level(level: dict, server: subprocess.Popen, log: str | None, name: str = "") -> None:
    """Say at once how a level went: what failed (the requests' errors), and whether the server is alive."""
    print(
        f"{name or 'concurrency'} {level['concurrency']}: {level['completed']} completed, {level['failed']} failed, "
        f"{level['output_throughput']:.0f} output tok/s",
        flush=True,
    )
    if level["failed"]:
        print(
            f"concurrency {level['concurrency']}: {level['failed']} of {level['failed'] + level['completed']} "
            f"requests failed: {level['errors']}",
            file=sys.stderr,
        )
    if server.poll() is not None:
        raise SystemExit(f"the server exited with code {server.returncode} during the benchmark{server_log_tail(log)}")
    if not level["completed"]:
        raise SystemExit(f"every request failed, the server still running{server_log_tail(log)}")


def stats(values: list[float], name: str) -> dict:
    v = np.asarray(values, dtype=float) * 1000 if values else np.zeros(1)
    return {
        f"mean_{name}_ms": float(v.mean()),
        f"p50_{name}_ms": float(np.percentile(v, 50)),
        f"p99_{name}_ms": float(np.percentile(v, 99)),
    }


def summarize(results: list[dict], duration: float, concurrency: int, rate: float, start: float) -> dict:
    errors = [r["error"] for r in results if "error" in r]
    results = [r for r in results if "error" not in r]
    out_tokens = sum(r["output_tokens"] for r in results)
    in_tokens = sum(r["input_tokens"] for r in results)
    return dict(
        concurrency=concurrency,
        request_rate=rate if rate != float("inf") else "inf",
        completed=len(results),
        failed=len(errors),
        errors=sorted(set(errors))[:5],
        duration_s=duration,
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=len(results) / duration,
        output_throughput=out_tokens / duration,
        total_token_throughput=(in_tokens + out_tokens) / duration,
        **stats([r["ttft"] for r in results], "ttft"),
        **stats([r["tpot"] for r in results], "tpot"),
        **stats([i for r in results for i in r["itl"]], "itl"),
        **stats([r["latency"] for r in results], "e2el"),
        # each request's send (s after the level's start) and TTFT (ms), in send order: where a TTFT tail comes from
        sent_s_ttft_ms=sorted((round(r["start"] - start, 4), round(r["ttft"] * 1e3, 2)) for r in results),
    )


def print_table(levels: list[dict], device: str, model: str) -> None:
    cols = [
        ("api_server_count", "API srv", "{}"),
        ("concurrency", "conc", "{}"),
        ("request_rate", "rate", "{}"),
        ("completed", "reqs", "{}"),
        ("failed", "failed", "{}"),
        ("request_throughput", "req/s", "{:.2f}"),
        ("output_throughput", "out tok/s", "{:.1f}"),
        ("offline_output_throughput", "offline", "{:.1f}"),
        ("served_over_offline", "ratio", "{:.2f}"),
        ("offline_capped_output_throughput", "offline, <= conc at once", "{:.1f}"),
        ("cpu_us_per_token_engine", "CPU us/tok: engine", "{:.0f}"),
        ("cpu_us_per_token_engine_sys", "(in kernel)", "{:.0f}"),
        ("cpu_us_per_token_api", "api", "{:.0f}"),
        ("cpu_us_per_token_client", "client", "{:.0f}"),
        ("client_loop_lag_max_ms", "client lag max", "{:.0f}"),
        ("mean_ttft_ms", "TTFT mean", "{:.0f}"),
        ("p50_ttft_ms", "p50", "{:.0f}"),
        ("p99_ttft_ms", "p99", "{:.0f}"),
        ("server_ttft_share_within_500ms", "server TTFT <= 0.5 s", "{:.3f}"),
        ("mean_tpot_ms", "TPOT mean", "{:.1f}"),
        ("p50_tpot_ms", "p50", "{:.1f}"),
        ("p99_tpot_ms", "p99", "{:.1f}"),
        ("mean_itl_ms", "ITL mean", "{:.1f}"),
        ("p50_itl_ms", "p50", "{:.1f}"),
        ("p99_itl_ms", "p99", "{:.1f}"),
    ]
    print(f"minivllm serving benchmark on {device}, model {model} (latencies in ms)")
    cols = [c for c in cols if c[0] in levels[0]]  # (the capped offline column: CPU runs only)
    rows = [[h for _, h, _ in cols]] + [[f.format(level[k]) for k, _, f in cols] for level in levels]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def plot(levels: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({lv["api_server_count"] for lv in levels})
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, name, label in (
        (axes[0], "ttft", "time to first token (ms)"),
        (axes[1], "tpot", "time per output token (ms)"),
    ):
        for count in counts:
            mine = [lv for lv in levels if lv["api_server_count"] == count]
            conc = [lv["concurrency"] for lv in mine]
            for q, style in (("mean", "o-"), ("p99", "^:")):
                ax.plot(conc, [lv[f"{q}_{name}_ms"] for lv in mine], style, label=f"{q}, {count} API server(s)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=80)
    print(f"wrote {path}")


def offline_throughputs(
    model: str | None, server_args: list[str], levels: list[list[list[int]]], warm, output_len, max_num_seqs=None
) -> list[float]:
    """Output tok/s of the offline `LLM.generate` on each level's requests (all at once, greedy, ignore_eos),
    with the server's engine arguments (and `max_num_seqs`, if given); one warm-up generate first, a cold
    prefix cache for each level."""
    from minivllm import LLM, SamplingParams
    from minivllm.frontend.default_model import default_model_dir
    from minivllm.serve.cli import ENGINE_ARGS, parse_serve_args

    parsed = parse_serve_args(server_args)
    engine_args = {k: getattr(parsed, k) for k in ENGINE_ARGS if getattr(parsed, k) is not None}
    if max_num_seqs is not None:
        engine_args["max_num_seqs"] = min(max_num_seqs, engine_args.get("max_num_seqs", max_num_seqs))
    llm = LLM(model or default_model_dir(), **engine_args)
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    try:
        llm.generate([{"prompt_token_ids": p} for p in warm], sp, use_tqdm=False)
        out = []
        for prompts in levels:
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            out.append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
            cap = f", at most {max_num_seqs} at once" if max_num_seqs else ""
            print(f"offline on {len(prompts)} requests{cap}: {out[-1]:.0f} output tok/s", flush=True)
        return out
    finally:
        llm.exit()


def serve_levels(model: str | None, flags: list[str], args, sweep, prompts_of, warm) -> list[dict]:
    """Start one server (`flags`), run every level of the sweep on it (a cold prefix cache each), stop it."""
    port = free_port()
    server = start_server(model, port, flags, args.server_log_level, args.server_log, args.server_env)
    url = f"http://127.0.0.1:{port}"
    levels = []
    try:
        served = httpx.get(url + "/v1/models").json()["data"][0]
        count = len([p for p in psutil.Process(server.pid).children(recursive=True) if p.name() == API_SERVER]) or 1
        warmup = asyncio.run(run_level(url + "/v1/completions", served["id"], warm, 8, 4, float("inf")))  # JIT
        check_level(warmup, server, args.server_log, "warm-up at concurrency")
        meter = CpuMeter(server.pid)
        meter.wait_quiet()  # (API servers still starting, or a tokenizer worker loading, are not a level's cost)
        for (c, rate), prompts in zip(sweep, prompts_of):
            httpx.post(url + "/reset_prefix_cache")
            before, ttft_before = meter.read(), ttft_buckets(url)
            with client_gc_paused():
                level = asyncio.run(run_level(url + "/v1/completions", served["id"], prompts, args.output_len, c, rate))
            level.update(meter.per_token(before, meter.read(), level["total_output_tokens"]))
            # the server's own TTFT (from arrival in an API server): the share within the target's 0.5 s
            level.update(server_ttft_share_within_500ms=share_within(ttft_before, ttft_buckets(url), 0.5))
            level.update(api_server_count=count, served_model_name=served["id"])
            levels.append(level)
            check_level(levels[-1], server, args.server_log, f"{count} API server(s), concurrency")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    return levels


PRESETS = {  # --preset cpu: the CPU target's shape (served >= 0.7x offline at 128 streams)
    "cpu": dict(model=TINY_QWEN3, concurrency=[1, 16, 64, 128], input_len=64, output_len=64, num_prompts_per=2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help=f"checkpoint dir, {RANDOM_QWEN3} or {TINY_QWEN3} (default: the embedded SmolLM2)")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="cpu: a tiny Qwen3 at 1-128 streams, 64 in / 64 out")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="levels of the sweep")
    ap.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[],
        help="a sweep of Poisson arrival rates (requests/s) at the highest concurrency, after the concurrency sweep",
    )
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per level (default: 4 x concurrency)")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument(
        "--api-server-count",
        type=int,
        nargs="+",
        default=None,
        help="a sweep of `minivllm serve --api-server-count` values, e.g. 1 4 (default: the server's own default)",
    )
    ap.add_argument("--server-args", default="", help='extra `minivllm serve` arguments, e.g. "--max-num-seqs 64"')
    ap.add_argument(
        "--server-env",
        type=env_pair,
        nargs="+",
        default=[],
        help="KEY=VALUE added to the servers' environment alone, e.g. OMP_NUM_THREADS=12 (the offline runs keep ours)",
    )
    ap.add_argument("--no-offline", action="store_true", help="skip the offline LLM.generate runs")
    ap.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "minivllm"))
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve_<device>.json)")
    ap.add_argument("--figure", default=None, help="also draw TTFT and TPOT against concurrency to this PNG")
    ap.add_argument("--server-log", default=None, help="the server's output to this file (default: this terminal)")
    ap.add_argument("--server-log-level", default="warning", help="the server's --log-level (default warning)")
    args = ap.parse_args()
    args.server_env = dict(args.server_env)
    import torch

    gpu = torch.cuda.is_available()
    if not gpu:
        build_cpu_operators()
    preset = PRESETS.get(args.preset, {})
    args.model = args.model or preset.get("model")
    args.concurrency = (
        args.concurrency or preset.get("concurrency") or ([1, 4, 16, 64, 256] if gpu else [1, 2, 4, 8, 16])
    )
    args.input_len = args.input_len or preset.get("input_len") or (512 if gpu else 128)
    args.output_len = args.output_len or preset.get("output_len") or (128 if gpu else 32)
    per = preset.get("num_prompts_per", 4)
    model = model_dir(args.model, args.cache)
    if args.server_log:  # every server of the sweep appends its output
        open(args.server_log, "w").close()
    vocab_top = min(10000, vocab_size(model) - 1)  # random prompt ids, below the model's vocabulary
    rng = random.Random(0)
    warm = [[rng.randint(1, vocab_top) for _ in range(args.input_len)] for _ in range(4)]
    sweep = [(c, float("inf")) for c in args.concurrency]
    sweep += [(max(args.concurrency), rate) for rate in args.request_rate if rate != float("inf")]
    prompts_of = []  # each level's requests, the same for every API-server count and for the offline runs
    for c, _ in sweep:
        n = args.num_prompts or max(per * c, 8)
        prompts_of.append([[rng.randint(1, vocab_top) for _ in range(args.input_len)] for _ in range(n)])
    levels = []
    for count in args.api_server_count or [None]:  # None: the server's default
        flags = args.server_args.split() + (["--api-server-count", str(count)] if count is not None else [])
        levels += serve_levels(model, flags, args, sweep, prompts_of, warm)
    served_name = levels[0].pop("served_model_name")
    for level in levels[1:]:
        level.pop("served_model_name")
    if not args.no_offline:  # the servers are gone: the engine alone on the same machine, the same requests
        offline = offline_throughputs(model, args.server_args.split(), prompts_of, warm, args.output_len)
        capped = {}
        if not gpu:  # the engine alone with at most `concurrency` sequences at once: no server can pass this
            for (c, rate), prompts in zip(sweep, prompts_of):
                (capped[c, rate],) = offline_throughputs(
                    model, args.server_args.split(), [prompts], warm, args.output_len, c
                )
        for i, level in enumerate(levels):
            tps = offline[i % len(sweep)]
            level.update(offline_output_throughput=tps, served_over_offline=level["output_throughput"] / tps)
            if capped:
                level.update(offline_capped_output_throughput=capped[sweep[i % len(sweep)]])
    else:
        for level in levels:
            level.update(offline_output_throughput=float("nan"), served_over_offline=float("nan"))
    device = torch.cuda.get_device_name() if gpu else "cpu"
    print_table(levels, device, served_name)
    host = machine()
    if not gpu:
        print("CPU operators:", host["cpu_ops"])
    result = dict(
        device=device,
        machine=host,
        model=served_name,
        api_server_counts=sorted({lv["api_server_count"] for lv in levels}),
        input_len=args.input_len,
        output_len=args.output_len,
        request_rates=[r for r in args.request_rate if r != float("inf")],
        server_args=args.server_args,
        server_env=args.server_env,
        levels=levels,
    )
    name = f"serve_{'gpu' if gpu else 'cpu'}{'_preset' if args.preset else ''}.json"
    save_json(result, args.out or os.path.join("benchmarks", "results", name))
    if args.figure:
        plot(
            [lv for lv in levels if lv["request_rate"] == "inf"] or levels,
            args.figure,
            f"minivllm serve on {device}: {served_name}, {args.input_len} in / {args.output_len} out",
        )


def env_pair(text: str) -> tuple[str, str]:
    """--server-env's KEY=VALUE."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def build_cpu_operators() -> None:
    """This machine's C++ CPU operators, built as `scripts/setup.sh` builds them (~20 s once; a later run finds the
    build), so that the engine measured on a host that never ran setup.sh is the one a user has, not the torch ops."""
    from minivllm.kernels.cpu import build

    try:
        build.build()
    except (RuntimeError, OSError) as e:
        print(f"the CPU operators were not built; the engine runs the torch ops: {e}", flush=True)


def machine() -> dict:
    """The host, and on the CPU which small operators the engine ran: this machine's C++ build or, where it is
    not built (`scripts/setup.sh` builds it), the torch ops, several times the per-step cost."""
    import platform

    import torch

    out = dict(host=platform.node(), cpu=platform.processor() or platform.machine(), cores=os.cpu_count())
    if not torch.cuda.is_available():
        from minivllm.kernels.cpu import ops

        out["cpu_ops"] = "C++" if ops.loaded() else f"torch: {ops.not_loaded_reason()}"
    return out


if __name__ == "__main__":
    main()
