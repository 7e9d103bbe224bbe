"""The OpenAI-compatible server (minivllm/serve/, serve/async_llm.py) with the real `openai` client on a
tiny model: completions and chat (also streamed) equal the offline LLM's outputs, vLLM's extra sampling
fields reach the engine, bad requests get a 400 with OpenAI's error body and the server keeps serving,
64 concurrent streaming clients get offline generate's greedy tokens and leave every KV block free, a client
that disconnects aborts its request; `python3 -m minivllm serve` stops cleanly on SIGINT / SIGTERM (also with
TP=2) and leaves no process or port behind."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.tp_workers import free_port
from minivllm.serve.async_llm import AsyncLLM
from minivllm.serve.cli import port_free, serve_main
from minivllm.serve.openai_server import ServerThread
from minivllm.serve.server_options import ServerOptions

ARGS = dict(kvcache_block_size=16, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256)
BLOCKS = 32  # small: 64 clients make the scheduler preempt
NAME = "tiny"
_gen = torch.Generator().manual_seed(11)
IDS = [torch.randint(1, 512, (int(n),), generator=_gen).tolist() for n in torch.randint(3, 60, (64,), generator=_gen)]
CONVERSATION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def offline(chat_model):
    llm = LLM(chat_model, num_kvcache_blocks=BLOCKS, **ARGS)
    yield llm
    llm.exit()


@pytest.fixture(scope="module")
def server(chat_model):
    llm = AsyncLLM(chat_model, num_kvcache_blocks=BLOCKS, **ARGS)
    with ServerThread(llm, NAME, options=ServerOptions(dev_mode=True)) as srv:
        srv.llm = llm
        yield srv
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{**dict(temperature=0, max_tokens=8, ignore_eos=True), **kw})


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def all_blocks_free(llm: AsyncLLM) -> bool:
    bm = llm.engine.scheduler.block_manager
    return not llm.engine.requests and bm.num_free_blocks == len(bm.blocks) and not bm.used_block_ids


# --- the endpoints ---------------------------------------------------------------------------------------------


def test_models_health_and_reset_prefix_cache(server, client):
    (card,) = client.models.list().data
    assert card.id == NAME and card.object == "model"
    assert httpx.get(server.url + "/health").status_code == 200
    prompt = IDS[0] * 3  # > 2 blocks
    client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    bm = server.llm.engine.scheduler.block_manager
    hits = bm.num_prefix_hits
    client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    assert bm.num_prefix_hits > hits
    assert httpx.post(server.url + "/reset_prefix_cache").json() == {"reset": True}
    hits = bm.num_prefix_hits
    client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    assert bm.num_prefix_hits == hits  # cold


def test_completions_equal_offline_generate(client, offline):
    tok = offline.get_tokenizer()
    texts = ["The quick brown fox", "Paris is"]
    extra = dict(ignore_eos=True, return_tokens_as_token_ids=True)
    for prompt, prompts in [
        (texts[0], texts[:1]),
        (texts, texts),
        (IDS[0], [IDS[0]]),
        (IDS[:3], IDS[:3]),
    ]:
        r = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=0, extra_body=extra
        )
        ref = offline.generate(prompts, greedy(), use_tqdm=False)
        assert [c.index for c in r.choices] == list(range(len(prompts)))
        assert [c.text for c in r.choices] == [o.text for o in ref]
        assert [[int(t.split(":")[1]) for t in c.logprobs.tokens] for c in r.choices] == [o.token_ids for o in ref]
        assert all(c.finish_reason == "length" for c in r.choices)
        prompt_tokens = sum(len(tok.encode(p)) if isinstance(p, str) else len(p) for p in prompts)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, 8 * len(prompts))
        assert r.usage.total_tokens == prompt_tokens + 8 * len(prompts)
    two = client.completions.create(model=NAME, prompt=texts, max_tokens=4, n=2, seed=3, temperature=1.0)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    ref = offline.generate(texts, SamplingParams(n=2, seed=3, max_tokens=4), use_tqdm=False)
    assert [c.text for c in two.choices] == [c.text for o in ref for c in o.outputs]
    echo = client.completions.create(model=NAME, prompt=texts[1], max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text == texts[1] + offline.generate(texts[1], greedy(max_tokens=3), use_tqdm=False)[0].text


def test_chat_equals_llm_chat(client, offline):
    r = client.chat.completions.create(model=NAME, messages=CONVERSATION, max_tokens=8, temperature=0)
    (ref,) = offline.chat(CONVERSATION, greedy(ignore_eos=False), use_tqdm=False)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    lp = client.chat.completions.create(
        model=NAME, messages=CONVERSATION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob for c in content)  # greedy took the most likely one


def test_streams_add_up_to_the_full_responses(server, client):
    full = client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt="The quick brown fox",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    chat_full = client.chat.completions.create(model=NAME, messages=CONVERSATION, max_tokens=10, temperature=0)
    chat_chunks = list(
        client.chat.completions.create(model=NAME, messages=CONVERSATION, max_tokens=10, temperature=0, stream=True)
    )
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat_full.choices[0].message.content
    assert chat_chunks[-1].choices[0].finish_reason == chat_full.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chat_chunks)
    body = dict(model=NAME, prompt="hi", max_tokens=3, stream=True)
    raw = httpx.post(server.url + "/v1/completions", json=body).text
    events = [line for line in raw.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_vllm_sampling_fields_reach_the_engine(client, offline):
    kw = dict(top_k=3, min_tokens=5, repetition_penalty=1.3, stop_token_ids=[7], seed=5, ignore_eos=True)
    r = client.completions.create(
        model=NAME, prompt=IDS[5], max_tokens=10, temperature=0.9, top_p=0.8, presence_penalty=0.5, extra_body=kw
    )
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, presence_penalty=0.5, **kw)
    assert r.choices[0].text == offline.generate(IDS[5], sp, use_tqdm=False)[0].text
    stop = offline.generate("The quick brown fox", greedy(max_tokens=12), use_tqdm=False)[0].text[3:5]
    for include in (False, True):
        s = client.completions.create(
            model=NAME,
            prompt="The quick brown fox",
            max_tokens=12,
            temperature=0,
            stop=[stop],
            extra_body=dict(include_stop_str_in_output=include),
        )
        ref = offline.generate(
            "The quick brown fox",
            greedy(max_tokens=12, stop=[stop], include_stop_str_in_output=include),
            use_tqdm=False,
        )[0]
        assert s.choices[0].text == ref.text and s.choices[0].finish_reason == "stop"
        assert s.choices[0].model_extra["stop_reason"] == stop


# --- bad requests ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, message, param",
    [
        ("completions", "{not json", "malformed JSON body", None),
        ("completions", dict(model=NAME), "prompt: Field required", "prompt"),
        (
            "completions",
            dict(prompt="hi", max_tokens="ten"),
            "max_tokens: Input should be a valid integer",
            "max_tokens",
        ),
        ("completions", dict(prompt=5), "prompt", "prompt"),
        ("completions", dict(prompt=[]), "prompt must not be empty", "prompt"),
        ("completions", dict(prompt=list(range(1, 300))), "exceeds max_model_len 256", "max_tokens"),
        ("completions", dict(prompt="hi", max_tokens=1000), "max_tokens 1000", "max_tokens"),
        ("completions", dict(prompt=[600]), r"token ids [600] are outside the vocabulary", "prompt"),
        ("completions", dict(prompt="hi", n=0), "n must be an integer >= 1", "n"),
        ("completions", dict(prompt="hi", logprobs=21), "logprobs must be an integer in [0, 20]", "logprobs"),
        ("completions", dict(prompt="hi", stop=[""]), "stop must be a string or a list of non-empty", "stop"),
        (
            "completions",
            dict(prompt="hi", temperature="hot"),
            "temperature: Input should be a valid number",
            "temperature",
        ),
        ("completions", dict(prompt="hi", suffix="x"), "suffix is not supported", "suffix"),
        ("chat/completions", dict(messages="hi"), "messages: Input should be a valid list", "messages"),
        ("chat/completions", dict(messages=[]), "messages: List should have at least 1 item", "messages"),
        ("chat/completions", dict(messages=[{"content": "x"}]), "messages.0.role: Field required", "messages"),
        (
            "chat/completions",
            dict(messages=CONVERSATION, top_logprobs=2),
            "top_logprobs needs logprobs",
            "top_logprobs",
        ),
        (
            "chat/completions",
            dict(messages=CONVERSATION, logprobs=True, top_logprobs=30),
            "logprobs must be",
            "logprobs",
        ),
        ("chat/completions", dict(messages=[{"role": "user", "content": "x" * 900}]), "max_model_len 256", "messages"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(server, client, path, body, message, param):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/{path}", content=data, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert message in error["message"] and error["param"] == param, error
    ok = client.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2
    assert all_blocks_free(server.llm)


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=NAME, messages=CONVERSATION, temperature=-1)


def test_an_unknown_model_is_404_not_found(server, client):
    """As vLLM: a model the server does not serve is 404 (the openai client's NotFoundError), and nothing runs."""
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.chat.completions.create(model="nope", messages=CONVERSATION)
    r = httpx.post(f"{server.url}/v1/completions", json=dict(prompt="hi", model="gpt-4"))
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    assert all_blocks_free(server.llm)


# --- many clients at once, disconnects ----------------------------------------------------------------------------


def test_64_concurrent_streaming_clients_get_offline_tokens(server, offline):
    max_tokens = [4 + (7 * i) % 21 for i in range(64)]
    steps = server.llm.engine.step_log.mark()
    preemptions = server.llm.engine.scheduler.num_preemptions

    async def one(aclient, i: int) -> list[int]:
        stream = await aclient.completions.create(
            model=NAME,
            prompt=IDS[i],
            max_tokens=max_tokens[i],
            temperature=0,
            stream=True,
            logprobs=0,
            extra_body=dict(ignore_eos=True, return_tokens_as_token_ids=True),
        )
        tokens = []
        async for chunk in stream:
            tokens += [int(t.split(":")[1]) for t in chunk.choices[0].logprobs.tokens]
        return tokens

    async def main() -> list[list[int]]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*[one(aclient, i) for i in range(64)])
        finally:
            await aclient.close()

    got = asyncio.run(main())
    ref = offline.generate(IDS, [greedy(max_tokens=n) for n in max_tokens], use_tqdm=False)
    assert got == [o.token_ids for o in ref]
    log = server.llm.engine.step_log.since(steps)
    assert max(r.num_seqs for r in log) > 8  # they really ran together
    assert server.llm.engine.scheduler.num_preemptions > preemptions  # and the cache ran full
    wait_until(lambda: all_blocks_free(server.llm))


def running_request(llm: AsyncLLM, prefix: str):
    wait_until(lambda: any(r.startswith(prefix) for r in list(llm.engine.requests)))
    rid = next(r for r in list(llm.engine.requests) if r.startswith(prefix))
    return llm.engine.requests[rid].seqs[0]


def test_a_client_that_disconnects_aborts_its_request(server):
    body = dict(model=NAME, prompt=IDS[1], max_tokens=200, temperature=0, stream=True, ignore_eos=True)
    with httpx.Client(timeout=60) as h, h.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        seq = running_request(server.llm, first["id"])
    # the connection is closed here, mid-stream
    wait_until(lambda: seq.is_finished)
    assert seq.finish_reason == "abort" and len(seq.output_token_ids) < 200
    wait_until(lambda: all_blocks_free(server.llm))
    # the same for a request that does not stream: the client goes away before the answer
    port = int(server.url.rsplit(":", 1)[1])
    payload = json.dumps(dict(model=NAME, prompt=IDS[2], max_tokens=200, temperature=0, ignore_eos=True)).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    seq = running_request(server.llm, "cmpl-")
    sock.close()
    wait_until(lambda: seq.is_finished)
    assert seq.finish_reason == "abort"
    wait_until(lambda: all_blocks_free(server.llm))


# --- the command line: start-up errors, signals ------------------------------------------------------------------


def test_serve_imports_the_server_only_when_serving_and_refuses_a_busy_port(tiny_qwen3, capsys):
    code = "import sys, minivllm.__main__; assert 'fastapi' not in sys.modules and 'uvicorn' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ}).returncode == 0
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert serve_main(["--model", tiny_qwen3, "--port", str(busy.getsockname()[1])]) == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


def test_a_port_left_in_time_wait_is_free_to_serve_again():
    """A server that just stopped leaves its closed connections in TIME_WAIT on its port; `minivllm serve` run again
    on that port must not be refused (uvicorn binds with SO_REUSEADDR), while a port something listens on is."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not port_free("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port)):
            conn, _ = listener.accept()
            conn.close()  # the server's side closes first: it waits in TIME_WAIT on `port`
            time.sleep(0.1)
    assert port_free("127.0.0.1", port)


def test_keep_alive_timeout_reaches_uvicorn(tiny_qwen3, monkeypatch, capsys):
    """--timeout-keep-alive (default 60 s, not uvicorn's 5: a request sent on a kept-alive connection while a
    compile stalls the server can otherwise be reset unanswered; openai_server.py) reaches uvicorn's Config; a
    value <= 0 is refused before the engine starts."""
    from minivllm.serve import cli, launcher, openai_server

    assert cli.parse_serve_args([]).timeout_keep_alive == openai_server.TIMEOUT_KEEP_ALIVE == 60
    seen = {}

    def run(server, sockets=None):  # uvicorn's serving loop, replaced: what it was configured with is what matters
        seen.update(keep_alive=server.config.timeout_keep_alive, port=server.config.port, seed=server.llm.info.seed)

    monkeypatch.setattr(launcher.Server, "run", run)
    port = free_port()
    flags = ["--timeout-keep-alive", "42", "--seed", "3", "--api-server-count", "1"]
    assert serve_main(["--model", tiny_qwen3, "--port", str(port), *flags]) == 0
    assert seen == {"keep_alive": 42.0, "port": port, "seed": 3}
    assert serve_main(["--model", tiny_qwen3, "--timeout-keep-alive", "0"]) == 2
    assert "--timeout-keep-alive must be > 0 seconds, got 0.0" in capsys.readouterr().err


def start_server(model: str, port: int, *flags: str, env: dict | None = None) -> subprocess.Popen:
    """`minivllm serve` in a subprocess, once /health answers; one API server unless `flags` say otherwise (the
    default depends on the host's cores)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **(env or {}), "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "minivllm", "serve", "--model", model, "--port", str(port), "--max-model-len", "512"]
    cmd += [] if "--api-server-count" in flags else ["--api-server-count", "1"]
    proc = subprocess.Popen(
        [*cmd, "--device", "cpu", "--log-level", "warning", *flags], env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() < deadline, "the server did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("sig, tp", [(signal.SIGINT, 1), (signal.SIGTERM, 2)])
def test_signal_ends_requests_and_leaves_nothing_behind(chat_model, sig, tp):
    port = free_port()
    proc = start_server(chat_model, port, "--tensor-parallel-size", str(tp))
    children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert len(children) >= tp - 1
    chunks, started = [], threading.Event()

    def client() -> None:
        body = dict(model=chat_model, prompt="hi", max_tokens=400, temperature=0, stream=True, ignore_eos=True)
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    chunks.append(line)
                    started.set()

    reader = threading.Thread(target=client)
    reader.start()
    assert started.wait(60)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    reader.join(30)
    assert chunks[-1] == "data: [DONE]"
    assert json.loads(chunks[-2][6:])["choices"][0]["finish_reason"] == "abort"  # ended at once, not at 400 tokens
    assert "Traceback" not in proc.stderr.read()
    deadline = time.time() + 15
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in children):
        assert time.time() < deadline, "a TP worker outlived the server"
        time.sleep(0.1)
    assert port_free("127.0.0.1", port)  # nothing listens there any more (closed connections may wait in TIME_WAIT)
