"""`minivllm serve` under a supervisor (issue 42), as processes: when its engine core is killed, every open stream
ends with an error and the API server exits with status 1 within 5 s (vLLM's behaviour: its supervisor starts a
fresh one); when the API server is killed, the core and the tokenizer workers leave and the core removes the
directory of its IPC sockets."""

import glob
import json
import os
import signal
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from test_server import start_server

from minivllm.engine.tp_workers import free_port


def named(proc: subprocess.Popen, name: str) -> list[psutil.Process]:
    return [c for c in psutil.Process(proc.pid).children(recursive=True) if c.name() == name]


def wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.time() + timeout
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.time() < deadline, "a process outlived its parent"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_killed_core_makes_the_server_exit_nonzero_within_5_s(chat_model):
    port = free_port()
    proc = start_server(chat_model, port)
    (core,) = named(proc, "minivllm-core")
    children = psutil.Process(proc.pid).children(recursive=True)
    events, started = [], threading.Event()

    def client() -> None:
        body = dict(model=chat_model, prompt="hi", max_tokens=500, temperature=0, stream=True, ignore_eos=True)
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    reader = threading.Thread(target=client)
    reader.start()
    assert started.wait(60)
    killed = time.monotonic()
    os.kill(core.pid, signal.SIGKILL)
    code = proc.wait(timeout=30)
    exited = time.monotonic() - killed
    reader.join(30)
    stderr = proc.stderr.read()
    assert code == 1 and exited < 5, (code, exited, stderr[-2000:])
    assert "the engine core died" in stderr
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500, events[-3:]
    wait_gone([c.pid for c in children], 10)  # the tokenizer workers too


@pytest.mark.slow
def test_a_killed_api_server_leaves_no_process_and_no_ipc_directory(chat_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the server's temporary directories land here
    port = free_port()
    proc = start_server(chat_model, port)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert {c.name() for c in children} >= {"minivllm-core", "minivllm-tok"}
    (ipc,) = glob.glob(str(tmp_path / "minivllm-core-*"))
    assert os.listdir(ipc)  # the sockets
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    wait_gone([c.pid for c in children], 15)
    assert not os.path.exists(ipc)
