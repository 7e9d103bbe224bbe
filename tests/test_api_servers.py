"""`minivllm serve --api-server-count 2` (serve/api_servers.py): two API-server processes accept connections on one
port and share one engine core. Connections reach both processes (the per-process request counts in /metrics), the
answers are offline generate's greedy tokens (as with one API server), streaming and not; a client that disconnects
aborts its request in the core from whichever process held it; /metrics counts the whole server; the default count
follows the host's cores. SIGTERM ends every process (exit 0); a killed core ends open streams with an error and the
server with status 1; a killed API server ends the whole server (status 1); each leaves no process and no directory."""

import glob
import json
import os
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import torch
from test_server import start_server
from test_server_core import idle, metrics

from minivllm import LLM, SamplingParams
from minivllm.engine.tp_workers import free_port
from minivllm.serve.api_servers import API_SERVER, default_api_server_count
from minivllm.serve.cli import serve_main
from minivllm.serve.core import cpu_threads

_gen = torch.Generator().manual_seed(43)
IDS = [torch.randint(1, 512, (int(n),), generator=_gen).tolist() for n in torch.randint(3, 40, (16,), generator=_gen)]


def test_default_count_follows_the_cores():
    assert [default_api_server_count(c) for c in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]


def test_a_cpu_core_takes_at_most_half_the_cores_and_leaves_one_to_each_api_server():
    assert [cpu_threads(c, api_servers=1) for c in (1, 2, 4, 16, 64)] == [1, 1, 2, 8, 32]
    assert [cpu_threads(16, api_servers=n) for n in (1, 4, 8, 12, 16)] == [8, 8, 8, 4, 1]


def test_a_bad_count_or_a_busy_port_is_refused_before_anything_starts(tiny_qwen3, capsys):
    assert serve_main(["--model", tiny_qwen3, "--api-server-count", "0"]) == 2
    assert "--api-server-count must be >= 1, got 0" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert serve_main(["--model", tiny_qwen3, "--port", port, "--api-server-count", "2"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def processes(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def api_servers(proc: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in processes(proc) if p.name() == API_SERVER]


def wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.time() + timeout
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.time() < deadline, "a process outlived the server"
        time.sleep(0.05)


def stream(url: str, events: list, started: threading.Event | None = None, max_tokens: int = 1500) -> None:
    """One long streaming completion on a connection of its own, its SSE events appended to `events`."""
    body = dict(prompt=IDS[0], max_tokens=max_tokens, temperature=0, stream=True, ignore_eos=True)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if started is not None:
                        started.set()
    except httpx.TransportError as e:  # (a killed API server drops its connections)
        events.append(f"transport error: {e}")


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ipc"))  # the server's temporary directories land here
    port = free_port()
    flags = ["--api-server-count", "2", "--max-model-len", "2048", "--max-num-seqs", "1", "--stream-interval", "3"]
    proc = start_server(chat_model, port, *flags, env=dict(TMPDIR=tmp))
    deadline = time.time() + 60
    while len(api_servers(proc)) < 2:
        assert time.time() < deadline
        time.sleep(0.1)
    yield proc, f"http://127.0.0.1:{port}", tmp
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def offline(chat_model):
    llm = LLM(chat_model, device="cpu", max_model_len=2048)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    yield [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in IDS], sp, use_tqdm=False)]
    llm.exit()


def complete(url: str, ids: list[int], streaming: bool) -> list[int]:
    """Greedy token ids of one request on a fresh connection (tokens as `token_id:N`, streamed or not)."""
    body = dict(prompt=ids, max_tokens=12, temperature=0, ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True)
    if not streaming:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    else:
        tokens = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    tokens += json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_both_processes_serve_greedy_answers_and_metrics_count_the_whole_server(server, offline):
    proc, url, _ = server
    pids = {str(p.pid) for p in api_servers(proc)}
    key = 'vllm:request_success_total{finished_reason="length",model_name="%s"}'
    before = metrics(url)
    done, rounds = 0, 0
    with ThreadPoolExecutor(16) as pool:
        while True:  # which process accepts a connection is the kernel's choice: a few rounds until both did
            jobs = [pool.submit(complete, url, ids, i % 2 == 0) for i, ids in enumerate(IDS)]
            assert [j.result() for j in jobs] == offline  # streaming and not, on either process
            done, rounds = done + len(IDS), rounds + 1
            served = {k: v for k, v in metrics(url).items() if k.startswith("minivllm:api_server_requests")}
            if len(served) == 2 or rounds == 5:
                break
    assert {k.split('pid="')[1].split('"')[0] for k in served} == pids  # both API servers took requests
    assert sum(served.values()) - sum(v for k, v in before.items() if k in served) == done
    after = metrics(url)  # any process's /metrics: every process's counts
    model = [k for k in after if k.startswith("vllm:request_success_total")][0].split('model_name="')[1][:-2]
    assert after[key % model] - before.get(key % model, 0) == done
    idle(url)


def test_each_process_streams_with_the_servers_stream_interval(server, offline):
    """`--stream-interval 3` reaches every API-server process: a stream's 12 tokens come in a few events (the
    first token alone, then threes), the same greedy tokens as offline."""
    proc, url, _ = server
    body = dict(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True, stream=True)
    for ids, expected in zip(IDS[:6], offline):  # six connections: both processes, as the kernel spreads them
        counts, tokens = [], []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "prompt": ids}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got = json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]
                    counts.append(len(got))
                    tokens += [int(t.removeprefix("token_id:")) for t in got]
        assert tokens == expected
        assert len(counts) <= 1 + 4 + 1 and max(counts) >= 3, counts  # (one a token would be 12 events)


def test_a_client_disconnect_aborts_its_request_in_the_core(server):
    """Six streams of 1,900 tokens on six connections (both processes hold some); the server runs one sequence at
    a time (--max-num-seqs 1): 11,400 steps if nothing aborted them. Their clients leave: the core is idle at once."""
    _, url, _ = server
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    clients = [httpx.Client(timeout=60) for _ in range(6)]
    body = dict(prompt=IDS[1], max_tokens=1900, temperature=0, stream=True, ignore_eos=True)
    streams = [c.stream("POST", url + "/v1/completions", json=body) for c in clients]
    for s in streams:
        s.__enter__()  # the response's headers: the request is on its way to the core
    deadline = time.time() + 30
    while sum(metrics(url)[f'vllm:num_requests_{k}{{model_name="{model}"}}'] for k in ("running", "waiting")) < 6:
        assert time.time() < deadline, "the six requests did not reach the core"
        time.sleep(0.05)
    start = time.time()
    for s, c in zip(streams, clients):
        s.__exit__(None, None, None)
        c.close()
    idle(url, timeout=10)  # every request left the core, and their blocks are free
    assert time.time() - start < 10


def test_sigterm_ends_every_process_and_removes_the_directory(server):
    proc, url, tmp = server
    children = [p.pid for p in processes(proc)]
    (ipc,) = glob.glob(os.path.join(tmp, "minivllm-core-*"))
    events, started = [], threading.Event()
    reader = threading.Thread(target=stream, args=(url, events, started))
    reader.start()
    assert started.wait(60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
    reader.join(30)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort", events[-2:]
    wait_gone(children, 10)
    assert not os.path.exists(ipc)


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["core", "api server", "parent"])
def test_a_killed_process_ends_the_whole_server(chat_model, tmp_path, victim):
    """A killed core or API server: the parent exits 1. A killed parent: the core and the API servers leave by
    themselves (the core removes the directory)."""
    port = free_port()
    env = dict(TMPDIR=str(tmp_path))
    proc = start_server(chat_model, port, "--api-server-count", "2", "--max-model-len", "2048", env=env)
    deadline = time.time() + 60
    while len(api_servers(proc)) < 2:
        assert time.time() < deadline
        time.sleep(0.1)
    children = processes(proc)
    (ipc,) = glob.glob(str(tmp_path / "minivllm-core-*"))
    events = [[] for _ in range(4)]
    started = [threading.Event() for _ in events]
    url = f"http://127.0.0.1:{port}"
    readers = [threading.Thread(target=stream, args=(url, e, s)) for e, s in zip(events, started)]
    for r in readers:
        r.start()
    assert all(s.wait(60) for s in started)
    if victim == "parent":
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    else:
        target = [p for p in children if p.name() == ("minivllm-core" if victim == "core" else API_SERVER)][0]
        os.kill(target.pid, signal.SIGKILL)
        code = proc.wait(timeout=60)
        assert code == 1, proc.stderr.read()[-3000:]
    for r in readers:
        r.join(30)
    stderr = proc.stderr.read() if victim != "parent" else ""  # (the parent's children hold the pipe open)
    if victim == "core":  # every open stream, on either API server, ends with the error, then [DONE]
        assert "the engine core died" in stderr
        for e in events:
            assert e[-1] == "[DONE]" and json.loads(e[-2])["error"]["code"] == 500, e[-2:]
    elif victim == "api server":  # the killed process's streams drop; the other's end
        assert "API server" in stderr and "stopping" in stderr
        assert all(e[-1] == "[DONE]" or e[-1].startswith("transport error") for e in events)
    wait_gone([c.pid for c in children], 15)
    assert not os.path.exists(ipc)
