"""bench.py and benchmarks/: every script imports against the package as it is, and what bench.py records of an
engine (helpers.benchmark.engine_facts) and of its runs is what it says it is. Speed is never asserted
here: the benchmarks measure it."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from helpers import benchmark as bm

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = [ROOT / "bench.py", *sorted((ROOT / "benchmarks").glob("*.py"))]


def load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"bench_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # a script's main() runs only under __main__
    return module


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_imports(path):
    """A benchmark that no longer imports (a module it uses moved) fails here, not on the next GPU machine."""
    source = path.read_text()
    for line in source.splitlines():  # tests/ on the path (tests/helpers), never the repo root (minivllm itself)
        if "sys.path.insert" in line:
            assert line.strip().endswith('/ "tests"))  # tests/helpers'), f"{path.name}: import minivllm as installed"
    load(path)


def test_child_process_gets_the_parents_arguments(monkeypatch):
    bench = load(ROOT / "bench.py")
    monkeypatch.setattr(sys, "argv", ["bench.py", "--runs", "2", "--tp", "2", "--enforce-eager"])
    command = bench.child_command("/models/qwen3")
    assert command[1].endswith("bench.py")
    monkeypatch.setattr(sys, "argv", command[1:])
    args = bench.parse_args()
    assert (args.child, args.model, args.runs, args.tp, args.enforce_eager) == (True, "/models/qwen3", 2, 2, True)


def test_engine_facts_of_a_cpu_engine(tmp_path, monkeypatch):
    from triton.runtime.jit import JITFunction

    from helpers.compile_counter import CompileCounter
    from helpers.tiny_model import make_tiny_checkpoint
    from minivllm import LLM

    monkeypatch.setattr(JITFunction, "_do_compile", lambda self, key, *args: None)
    counter = CompileCounter()
    kernel = SimpleNamespace(__name__="toy_kernel")
    JITFunction._do_compile(kernel, "[('*bf16', 'D')]")  # one compile on this (the main) thread, one elsewhere
    other = threading.Thread(target=JITFunction._do_compile, args=(kernel, "[('*fp32', 'D')]"), name="compiler")
    other.start()
    other.join()
    llm = LLM(make_tiny_checkpoint(str(tmp_path / "m"), "qwen3"), device="cpu", max_model_len=128)
    try:
        facts = bm.engine_facts(llm, counter)
    finally:
        llm.exit()
    assert facts["backend"] == "torch" and facts["decode_kernel"] == "torch" and facts["device"] == "cpu"
    assert {"setup", "load"} <= set(facts["startup_phases"]) and all(s >= 0 for s in facts["startup_phases"].values())
    assert facts["kv_cache_blocks"] == llm.config.num_kvcache_blocks > 0
    assert [c[0] for c in facts["init_triton_compiles"]] == ["toy_kernel", "toy_kernel"]
    assert [c[2] for c in facts["init_triton_compiles"]] == ["MainThread", "compiler"]
    assert facts["init_triton_keys"][1] == ["toy_kernel", "[('*fp32', 'D')]"]
    assert facts["init_main_thread_compiles"] == 1


def test_greedy_agreement_stops_at_the_engines_first_eos():
    eos = {0}
    reference = [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]]
    ours = [
        [5, 6, 7, 8],  # equal
        [5, 6, 0, 9],  # EOS at 2, equal before it: transformers' min_new_tokens masked that EOS
        [5, 9, 0, 8],  # differs before its EOS
    ]
    assert bm.greedy_agreement(ours, reference, eos) == 2
    assert bm.greedy_agreement([[5, 6, 7, 9]], reference[:1], eos) == 0


def test_api_path_benchmark_streams_every_token(tmp_path):
    """bench_api_path.py drives the real API server (uvicorn's protocol, the app, the client's output thread) on a
    fake core: a short run ends, and each token of each stream reached the transport in one write (or fewer, where
    the collector merged a lagging stream's tokens), never more."""
    import subprocess

    env = {**__import__("os").environ, "HOME": str(tmp_path)}  # (the tiny checkpoint in a cache of its own)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_api_path.py"), "--streams", "4", "--num-requests", "8"]
    cmd += ["--output-len", "8", "--repeat", "1", "--step-ms", "20"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    result = eval(out.stdout.splitlines()[-2])  # the run's dict
    assert 0.75 <= result["writes_per_token"] <= 1.0 and result["us_per_token"] > 0, out.stdout  # (a lag merges)
    assert "api path:" in out.stdout.splitlines()[-1]


def test_serve_benchmark_reads_the_servers_ttft_histogram(monkeypatch):
    """bench_serve.py's server-side TTFT: the share of a level's requests the server's own histogram puts within
    0.5 s, from the /metrics text of several API servers (summed), counting only what the level added."""
    serve = load(ROOT / "benchmarks" / "bench_serve.py")

    def exposition(counts):  # cumulative counts at le=0.25, 0.5, +Inf, one line per API server
        lines = [
            f'vllm:time_to_first_token_seconds_bucket{{le="{le}",model_name="m",pid="{pid}"}} {c}'
            for pid, per_server in enumerate(counts)
            for le, c in zip(["0.25", "0.5", "+Inf"], per_server)
        ]
        return "\n".join(["# TYPE vllm:time_to_first_token_seconds histogram", *lines, "vllm:other 3.0"])

    class Reply:
        def __init__(self, text):
            self.text = text

    before = exposition([(1, 2, 2), (0, 0, 0)])
    after = exposition([(3, 4, 5), (2, 2, 4)])  # the level added 7 requests, 4 of them within 0.5 s
    replies = iter([Reply(before), Reply(after)])
    monkeypatch.setattr(serve.httpx, "get", lambda url: next(replies))
    b, a = serve.ttft_buckets("http://x"), serve.ttft_buckets("http://x")
    assert b == {0.25: 1.0, 0.5: 2.0, float("inf"): 2.0}
    assert a == {0.25: 5.0, 0.5: 6.0, float("inf"): 9.0}
    assert serve.share_within(b, a, 0.5) == pytest.approx(4 / 7)
    assert serve.share_within(b, a, 0.25) == pytest.approx(4 / 7)
    assert serve.share_within(a, a, 0.5) != serve.share_within(a, a, 0.5)  # no request in the level: nan


def test_serve_benchmark_client_runs_a_level_without_collections():
    """During a level the client's collector is off and the heap before it frozen (a full collection would stall
    the client's event loop: its TTFT, not the server's); after it, both as they were."""
    import gc

    serve = load(ROOT / "benchmarks" / "bench_serve.py")
    assert gc.isenabled()
    with serve.client_gc_paused():
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_serve_benchmark_records_which_cpu_operators_ran(monkeypatch):
    """On the CPU the result says whether the engine ran this machine's C++ operators or the torch ops (a host
    where they were not built steps several times slower at the CPU preset's batch sizes)."""
    from minivllm.kernels.cpu import ops

    serve = load(ROOT / "benchmarks" / "bench_serve.py")
    monkeypatch.setattr(ops, "loaded", lambda: True)
    assert serve.machine()["cpu_ops"] == "C++"
    monkeypatch.setattr(ops, "loaded", lambda: False)
    monkeypatch.setattr(ops, "not_loaded_reason", lambda: "not built on this machine")
    assert serve.machine()["cpu_ops"] == "torch: not built on this machine"


def test_serve_benchmark_gives_the_server_alone_its_environment(monkeypatch):
    """--server-env KEY=VALUE reaches the servers' environment, not the benchmark's own (its offline runs)."""
    serve = load(ROOT / "benchmarks" / "bench_serve.py")
    assert serve.env_pair("OMP_NUM_THREADS=12") == ("OMP_NUM_THREADS", "12")
    assert serve.env_pair("A=b=c") == ("A", "b=c")
    for bad in ("OMP_NUM_THREADS", "=12"):
        with pytest.raises(serve.argparse.ArgumentTypeError, match="expected KEY=VALUE"):
            serve.env_pair(bad)
    seen = {}

    class Started(Exception):
        pass

    def popen(cmd, env, **kw):
        seen.update(env)
        raise Started

    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with pytest.raises(Started):
        serve.start_server(None, 1, [], "warning", None, {"OMP_NUM_THREADS": "12"})
    assert seen["OMP_NUM_THREADS"] == "12" and "OMP_NUM_THREADS" not in os.environ


def test_serve_benchmark_builds_the_cpu_operators_where_they_are_missing(tmp_path, monkeypatch, capsys):
    """A host that never ran setup.sh (a GPU host's CPU preset) gets this machine's build before the benchmark,
    and a failed build is said and the benchmark goes on, on the torch ops."""
    from minivllm.kernels.cpu import build

    serve = load(ROOT / "benchmarks" / "bench_serve.py")
    calls = []
    monkeypatch.setattr(build, "build", lambda: calls.append(1) or str(tmp_path / "lib.so"))
    serve.build_cpu_operators()
    assert calls == [1]

    def fails():
        raise RuntimeError("no compiler built CPU ops that pass their self-test")

    monkeypatch.setattr(build, "build", fails)
    serve.build_cpu_operators()
    assert "the engine runs the torch ops: no compiler built" in capsys.readouterr().out


@pytest.mark.skipif(not pathlib.Path("/proc/self/comm").exists(), reason="process names from /proc (Linux)")
def test_serve_benchmark_meters_the_engine_and_its_time_in_the_kernel():
    """bench_serve.py's CpuMeter counts a child named as the engine core as the engine, and the part of its CPU
    time spent in the kernel (here: faulting in fresh pages, as a prefill's activations do) apart, within it: the
    child also computes in user space, which counts as the engine's and not as the kernel's."""
    serve = load(ROOT / "benchmarks" / "bench_serve.py")
    child = (
        "import mmap, sys\n"
        "from minivllm.engine.tp_workers import set_process_name\n"
        "from minivllm.serve.core import CORE\n"
        "set_process_name(CORE)\n"
        "print('named', flush=True)\n"
        "sys.stdin.readline()\n"  # the meter reads before
        "for _ in range(20):\n"
        "    m = mmap.mmap(-1, 64 << 20)\n"
        "    for i in range(0, 64 << 20, 4096): m[i] = 1\n"  # a page fault a page
        "    m.close()\n"
        "sum(i * i for i in range(3_000_000))\n"  # and CPU time in user space
        "print('done', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "named"
        meter = serve.CpuMeter(os.getpid())
        before = meter.read()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        after = meter.read()
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    engine, kernel = after["engine"] - before["engine"], after["engine_sys"] - before["engine_sys"]
    assert 0 < kernel < engine, (engine, kernel)
    assert engine >= 0.05  # ~330k page faults: tenths of a second of CPU, counted as the engine's


def test_trace_serve_accounts_for_every_token_of_a_served_level(tmp_path):
    """benchmarks/trace_serve.py on a small CPU level (1 API server, 8 streams, 16 requests = two waves): the
    engine core's traced steps launched exactly the level's tokens (every prompt token, every output token but the
    one each prefill samples), each wave reached the core after its sends and got first tokens after that, and the
    offline runs show the all-at-once and the capped generate."""
    out = tmp_path / "trace"
    args = ["--preset", "cpu", "--concurrency", "8", "--api-server-count", "1", "--num-prompts", "16"]
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trace_serve.py"), "--trace-dir", str(out), "--", *args],
                   check=True, timeout=600, capture_output=True)  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    level, served = summary["level"], summary["served"]
    assert level["completed"] == served["requests"] == 16 and len(served["waves"]) == 2
    assert served["core_tokens"] == level["total_input_tokens"] + level["total_output_tokens"] - 16
    for wave in served["waves"]:
        assert wave["sends"][0] <= wave["core_adds"][0] <= wave["first_tokens"][0] <= wave["ends"][0]
        assert wave["core_adds"][1] <= wave["first_tokens"][1]
    assert served["core_steps"] >= 2 * 64 and served["decode_step_ms"] > 0
    assert {16, 8} <= {run["max_seqs"] for run in summary["offline"]}  # all at once, and at most 8 at once
