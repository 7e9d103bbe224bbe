"""The GPU numbers README.md quotes are the recorded results': the warm runs, the first run, start-up and the
roofline ratio of `benchmarks/results/first_run_gpu.json` and `throughput_gpu.json` (notebook 15 prints the same
numbers from the same files). A new run that rewrites the JSON fails here until the README follows it."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def row(name: str) -> str:
    """The README performance table's row whose first column is `name`, its first column left out."""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith(f"| {name} |"):
            return line[len(name) + 4 :]
    raise AssertionError(f"README.md has no table row {name!r}")


def numbers(text: str) -> list[float]:
    """Every number of `text`, in order ("26,446" -> 26446.0)."""
    return [float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", text)]


@pytest.fixture(scope="module")
def first() -> dict:
    return json.loads((RESULTS / "first_run_gpu.json").read_text())


def test_warm_and_first_runs(first):
    bare, cached = first["processes"]["bare"], first["processes"]["cached"]
    tokens = bare["runs"][0]["tokens"]
    warm = numbers(row("GPU offline, warm runs").split("|")[0])
    assert warm == [
        round(bare["warm_tok_per_s"]),
        round(cached["warm_tok_per_s"]),
        round(tokens / bare["warm_tok_per_s"], 2),
    ]
    first_run = numbers(row("GPU offline, first run / warm").split("|")[0])
    assert first_run == [round(bare["first_over_warm"], 2), round(bare["runs"][0]["tok_per_s"])]
    init = numbers(row("GPU engine start, bare / cached").split("|")[0])
    assert init == [round(bare["init_s"], 1), round(cached["init_s"], 1)]


def test_roofline_ratio(first):
    latest = json.loads((RESULTS / "throughput_gpu.json").read_text())
    floor_s = first["processes"]["bare"]["floor"]["floor_s"]
    cells = row("GPU roofline floor of the workload").split("|")
    quoted, against = numbers(cells[0]), numbers(cells[1])
    warm_ratios = {
        round(p["runs"][0]["tokens"] / p["warm_tok_per_s"] / floor_s, 2) for p in first["processes"].values()
    }
    assert len(warm_ratios) == 1, f"bare and cached warm runs at {warm_ratios} x the floor: quote both"
    tokens = latest["tokens"]
    assert quoted == [round(floor_s, 2), round(tokens / floor_s), *warm_ratios]
    assert against[-2:] == [round(latest["tok_per_s"]), round(latest["measured_over_floor"], 2)]


def test_serving():
    gpu = json.loads((RESULTS / "serve_gpu.json").read_text())
    by_streams = {lv["concurrency"]: lv for lv in gpu["levels"] if lv["request_rate"] == "inf"}
    served, against = row("GPU serving, 1 / 16 / 64 / 256 streams").split("|")[:2]
    want = [round(by_streams[n]["output_throughput"]) for n in (1, 16, 64, 256)]
    assert numbers(served) == [*want, sum(lv["failed"] for lv in gpu["levels"])]
    assert numbers(against)[-2:] == [round(by_streams[256]["served_over_offline"], 2), 256]
    latency = numbers(row("GPU serving, TTFT / TPOT mean at 256 streams").split("|")[0])
    assert latency == [round(by_streams[256]["mean_ttft_ms"]), round(by_streams[256]["mean_tpot_ms"], 1)]
    cpu = json.loads((RESULTS / "serve_cpu_preset.json").read_text())
    top = max((lv for lv in cpu["levels"] if lv["request_rate"] == "inf"), key=lambda lv: lv["concurrency"])
    served, against = row("CPU serving, tiny Qwen3 at 128 streams (`--preset cpu`)").split("|")[:2]
    assert top["concurrency"] == 128 and numbers(served) == [round(top["output_throughput"])]
    offline = [round(top["offline_output_throughput"]), round(top["served_over_offline"], 2)]
    assert numbers(against)[:2] == offline


def test_serving_with_several_api_servers():
    """The README's H100 rows: 4 API-server processes against offline, and one process's ratio beside it."""
    gpu = json.loads((RESULTS / "serve_gpu_h100_api_servers.json").read_text())
    at = {(lv["api_server_count"], lv["concurrency"]): lv for lv in gpu["levels"] if lv["request_rate"] == "inf"}
    served, against = row("GPU serving on an H100, 4 API-server processes, 16 / 64 / 256 streams").split("|")[:2]
    want = [round(at[4, n]["output_throughput"]) for n in (16, 64, 256)]
    assert numbers(served) == [*want, sum(lv["failed"] for lv in gpu["levels"])]
    one, four = at[1, 256], at[4, 256]
    quoted = [round(four["served_over_offline"], 2), 256, 99, round(four["p99_ttft_ms"])]  # "TTFT p99 359 ms"
    quoted += [1, round(one["served_over_offline"], 2), round(one["p99_ttft_ms"])]
    assert numbers(against) == quoted
    cpu = json.loads((RESULTS / "serve_cpu_preset_h100_host.json").read_text())
    at = {(lv["api_server_count"], lv["concurrency"]): lv for lv in cpu["levels"] if lv["request_rate"] == "inf"}
    served, against = row("CPU serving on a 16-core GPU host (CUDA hidden), 4 API servers, 128 streams").split("|")[:2]
    assert numbers(served) == [round(at[4, 128]["output_throughput"])]
    ratios = [round(at[4, 128]["served_over_offline"], 2), 1, round(at[1, 128]["served_over_offline"], 2)]
    assert numbers(against) == [round(at[4, 128]["offline_output_throughput"]), *ratios]


def test_api_server_cpu_per_token():
    """The README's H100 row of the API server's CPU per token: medians of the alternated runs, and their ratio."""
    runs = json.loads((RESULTS / "api_server_cpu_ab_h100.json").read_text())["runs"]

    def median(tree: str, servers: int) -> float:
        cpu = sorted(
            lv["cpu_us_per_token_api"]
            for r in runs
            if r["tree"] == tree
            for lv in r["levels"]
            if lv.get("api_server_count", 1) == servers and lv["concurrency"] == 256
        )
        assert len(cpu) == 3, (tree, servers, cpu)
        return cpu[1]

    one, four, before = median("28b10fd", 1), median("28b10fd", 4), median("af5d86b", 1)
    name = "GPU serving on an H100, API-server CPU per streamed token at 256 streams"
    quoted, against = row(name).split("|")[:2]
    assert numbers(quoted) == [round(one), 1, round(four), 4, 3]
    assert numbers(against)[-2:] == [round(before), round(one / before, 2)]
