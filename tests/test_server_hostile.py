"""The server against hostile and careless requests (issue 42), each followed by /health and a 1-token completion:
integers beyond int64 or the vocabulary, `n` beyond vLLM's limit, a top_k beyond the vocabulary (no limit, as
vLLM), bodies FastAPI itself refuses (bad UTF-8, deep nesting, unknown paths and methods): every error in OpenAI's
shape; stream_options without stream; request chat templates refused unless trusted, a broken trusted template a
400; /reset_prefix_cache only in development mode; --api-key and CORS; a request that fails in the engine fails
alone (500, or an error event in its stream); a killed tokenizer worker fails only the request it held and is
replaced."""

import json
import os
import signal
import threading
import time

import httpx
import pytest

from helpers.poison import POISON, poison_generator_of
from minivllm.frontend.sampling_checks import MAX_N
from minivllm.serve.async_llm import AsyncLLM
from minivllm.serve.openai_server import ServerThread
from minivllm.serve.server_options import ServerOptions

ARGS = dict(kvcache_block_size=16, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256)
NAME = "tiny"
CONVERSATION = [{"role": "user", "content": "What is the capital of France?"}]
SLOW_TEMPLATE = "{% for i in range(4000) %}{% for j in range(4000) %}{% endfor %}{% endfor %}x"  # seconds of work


@pytest.fixture(scope="module")
def llm(chat_model):
    engine = AsyncLLM(chat_model, num_kvcache_blocks=32, **ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(llm, NAME, options=ServerOptions()) as srv:
        yield srv


@pytest.fixture(scope="module")
def trusting(llm):
    options = ServerOptions(trust_request_chat_template=True, dev_mode=True)
    with ServerThread(llm, NAME, options=options) as srv:
        yield srv


def assert_error(r: httpx.Response, status: int, message: str = "", param: str | None = "any") -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    assert message in error["message"], error
    assert param == "any" or error["param"] == param, error


def assert_serving(url: str, llm: AsyncLLM) -> None:
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.post(url + "/v1/completions", json=dict(prompt="hi", max_tokens=1), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    deadline = time.time() + 10
    while llm.engine.requests or llm.engine.scheduler.block_manager.used_block_ids:
        assert time.time() < deadline, "a request or a KV block was left behind"
        time.sleep(0.02)


BIG = [2**63, 2**64, 10**30]


@pytest.mark.parametrize(
    "path, body, message, param",
    [
        *[("completions", dict(prompt="hi", seed=s), "seed: Input should be", "seed") for s in BIG + [-(2**63) - 1]],
        ("completions", dict(prompt="hi", n=10**6), f"n must be an integer >= 1 and <= {MAX_N}", "n"),
        ("completions", dict(prompt="hi", n=MAX_N + 1), f"<= {MAX_N}", "n"),
        ("completions", dict(prompt="hi", n=2, seed=2**63 - 1), "within int64", "seed"),
        ("completions", dict(prompt=[[5]] * 3, n=MAX_N // 2), f"3 prompts x n {MAX_N // 2}", "prompt"),
        *[("completions", dict(prompt="hi", max_tokens=b), "max_tokens", "max_tokens") for b in BIG],
        *[("completions", dict(prompt="hi", min_tokens=b), "min_tokens", "min_tokens") for b in BIG],
        *[("completions", dict(prompt="hi", logprobs=b), "logprobs must be", "logprobs") for b in BIG],
        ("completions", dict(prompt="hi", prompt_logprobs=2**64), "prompt_logprobs must be", "prompt_logprobs"),
        ("completions", dict(prompt=[10**30]), "outside the vocabulary", "prompt"),
        ("completions", dict(prompt="hi", stop_token_ids=[2**64]), "stop_token_ids", "stop_token_ids"),
        ("completions", dict(prompt="hi", allowed_token_ids=[2**63]), "allowed_token_ids", "allowed_token_ids"),
        ("completions", dict(prompt="hi", logit_bias={str(10**30): 1}), "logit_bias", "logit_bias"),
        ("completions", dict(prompt="hi", logit_bias={"1e30": 1}), "logit_bias keys", "logit_bias"),
        ("completions", dict(prompt="hi", stream_options={"include_usage": True}), "stream", "stream_options"),
        ("chat/completions", dict(messages=CONVERSATION, logprobs=True, top_logprobs=2**64), "logprobs", "logprobs"),
        ("chat/completions", dict(messages=CONVERSATION, chat_template="x"), "trust-request-chat", "chat_template"),
        (
            "chat/completions",
            dict(messages=CONVERSATION, chat_template_kwargs={"chat_template": SLOW_TEMPLATE}),
            "--trust-request-chat-template",
            "chat_template",
        ),
    ],
)
def test_out_of_range_fields_are_a_400_naming_the_field(server, llm, path, body, message, param):
    r = httpx.post(f"{server.url}/v1/{path}", json=dict(model=NAME, **body), timeout=30)
    assert_error(r, 400, message, param)
    assert_serving(server.url, llm)


@pytest.mark.parametrize("top_k", [512, 2**63, 10**30])
def test_top_k_beyond_the_vocabulary_is_no_limit(server, llm, top_k):
    body = dict(model=NAME, prompt=[5, 6, 7], max_tokens=5, seed=4, temperature=1.0, ignore_eos=True)
    ref = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    r = httpx.post(server.url + "/v1/completions", json=dict(body, top_k=top_k), timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref, r.text
    assert_serving(server.url, llm)


@pytest.mark.parametrize(
    "method, path, content, status, message",
    [
        ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "error parsing the body"),
        ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "error parsing the body"),
        ("POST", "/v1/completions", b'{"prompt": ' * 5000 + b'"x"' + b"}" * 5000, 400, ""),
        ("POST", "/v1/completions", b"{not json", 400, "malformed JSON body"),
        ("POST", "/v1/completions", b'"a string"', 400, ""),
        ("POST", "/v1/nothing", b"{}", 404, "Not Found"),
        ("GET", "/v1/completions", b"", 405, "Method Not Allowed"),
        ("POST", "/reset_prefix_cache", b"", 404, "Not Found"),  # only in development mode
    ],
)
def test_every_error_is_in_openais_shape(server, llm, method, path, content, status, message):
    headers = {"content-type": "application/json"}
    r = httpx.request(method, server.url + path, content=content, headers=headers, timeout=30)
    assert_error(r, status, message)
    assert_serving(server.url, llm)


def test_trusted_templates_render_and_a_broken_one_is_a_400(trusting, llm):
    url = trusting.url + "/v1/chat/completions"
    body = dict(model=NAME, messages=CONVERSATION, max_tokens=2, temperature=0)
    ok = httpx.post(url, json=dict(body, chat_template="{{ messages[0]['content'] }} answer:"), timeout=30)
    assert ok.status_code == 200, ok.text
    tokens = httpx.post(trusting.url + "/tokenize", json=dict(messages=CONVERSATION, chat_template="{{ 'ab' }}"))
    assert tokens.status_code == 200 and tokens.json()["count"] >= 1
    for template, message in [
        ("{% for %}", "chat template error: TemplateSyntaxError"),
        ("{{ raise_exception('no') }}", "chat template error"),
        ("{{ ''.__class__.__mro__ }}", "chat template error: SecurityError"),
    ]:
        assert_error(httpx.post(url, json=dict(body, chat_template=template), timeout=30), 400, message, "messages")
    assert httpx.post(trusting.url + "/reset_prefix_cache").json() == {"reset": True}  # development mode
    assert_serving(trusting.url, llm)


def test_api_key_and_cors(llm):
    options = ServerOptions(api_keys=["sekrit", "other"], allowed_origins=["http://good.example"])
    with ServerThread(llm, NAME, options=options) as srv:
        assert_error(httpx.get(srv.url + "/v1/models"), 401, "Unauthorized")
        assert_error(httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        assert_error(httpx.get(srv.url + "/v1/models", headers={"Authorization": "Basic sekrit"}), 401)
        for key in ("sekrit", "other"):
            assert httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200  # outside /v1: open
        preflight = {"Origin": "http://good.example", "Access-Control-Request-Method": "POST"}
        r = httpx.options(srv.url + "/v1/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://good.example"
        bad = httpx.options(srv.url + "/v1/completions", headers=dict(preflight, Origin="http://evil.example"))
        assert "access-control-allow-origin" not in bad.headers
        auth = {"Authorization": "Bearer sekrit", "Origin": "http://good.example"}
        r = httpx.post(srv.url + "/v1/completions", json=dict(prompt="hi", max_tokens=1), headers=auth)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://good.example"
        r = httpx.post(srv.url + "/v1/completions", json=dict(prompt="hi", max_tokens=1, stream=True), headers=auth)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://good.example"  # (sse.py)
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8" and r.text.endswith("data: [DONE]\n\n")


def test_a_request_the_engine_fails_fails_alone(server, llm, monkeypatch):
    poison_generator_of(monkeypatch)
    bad = dict(model=NAME, prompt=[5, 6, 7], max_tokens=5, seed=POISON, temperature=1.0)
    good = dict(model=NAME, prompt=[5, 6, 7], max_tokens=5, seed=1, temperature=1.0, ignore_eos=True)
    results = {}

    def post(name: str, body: dict) -> None:
        results[name] = httpx.post(server.url + "/v1/completions", json=body, timeout=30)

    threads = [threading.Thread(target=post, args=a) for a in (("bad", bad), ("good", good))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_error(results["bad"], 500, "cannot seed this one")
    assert results["good"].status_code == 200 and results["good"].json()["usage"]["completion_tokens"] == 5
    events = httpx.post(server.url + "/v1/completions", json=dict(bad, stream=True), timeout=30).text.split("\n\n")
    events = [e.removeprefix("data: ") for e in events if e]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500, events
    assert_serving(server.url, llm)


@pytest.mark.slow
def test_a_killed_tokenizer_worker_fails_only_its_request_and_is_replaced(trusting, llm):
    tokens = trusting.app.state.tokens
    old = tokens.pids()
    slow = dict(model=NAME, messages=CONVERSATION, max_tokens=1, chat_template=SLOW_TEMPLATE)
    result = {}
    held = threading.Thread(
        target=lambda: result.update(r=httpx.post(trusting.url + "/v1/chat/completions", json=slow, timeout=120))
    )
    held.start()
    deadline = time.time() + 30
    while not any(w.holding is not None for w in tokens.workers):
        assert time.time() < deadline
        time.sleep(0.01)
    (busy,) = [w for w in tokens.workers if w.holding is not None]
    for _ in range(3):  # the other worker serves meanwhile
        chat = dict(model=NAME, messages=CONVERSATION, max_tokens=1)
        assert httpx.post(trusting.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
    os.kill(busy.process.pid, signal.SIGKILL)  # as the out-of-memory killer would
    held.join(60)
    assert_error(result["r"], 500, "the tokenizer worker died")
    deadline = time.time() + 60
    while busy.process is None or busy.process.pid in old or not busy.process.is_alive():
        assert time.time() < deadline, "the worker was not replaced"
        time.sleep(0.05)
    assert set(tokens.pids()) != set(old) and tokens.healthy
    (idle,) = [w for w in tokens.workers if w is not busy]
    os.kill(idle.process.pid, signal.SIGKILL)  # a worker that dies between jobs fails no request: it is replaced first
    idle.process.join(10)
    for _ in range(4):  # both workers serve text and chat again
        body = dict(prompt="hi", max_tokens=1)
        assert httpx.post(trusting.url + "/v1/completions", json=body, timeout=30).status_code == 200
        chat = dict(model=NAME, messages=CONVERSATION, max_tokens=1)
        assert httpx.post(trusting.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
    assert_serving(trusting.url, llm)


def test_a_pool_whose_workers_cannot_start_says_so(tmp_path, caplog):
    """/health tells the truth: a worker that cannot start (no tokenizer there) makes the pool unhealthy, a job
    fails at once (a 500) instead of waiting forever, and the log says why the worker could not start."""
    import asyncio

    from minivllm.serve.tokenizer_pool import TokenizerPool, WorkerDiedError

    pool = TokenizerPool(str(tmp_path), 64, workers=1)
    try:
        asyncio.run(pool.warm_up())
        assert not pool.healthy
        with pytest.raises(WorkerDiedError):
            asyncio.run(asyncio.wait_for(pool.encode("hi"), 60))
    finally:
        pool.shutdown()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors and all("could not load the tokenizer: ValueError: Unrecognized model" in e for e in errors), errors
    assert "config.json" in errors[0], errors


@pytest.mark.parametrize("after", [0.0, 0.5])
def test_a_pool_shut_down_while_its_workers_start_logs_no_error(llm, caplog, after):
    """shutdown() stops a worker still loading its tokenizer (made and not yet started, or loading): it returns,
    the worker's thread ends, and that is no failure to report."""
    import time

    from minivllm.serve.tokenizer_pool import TokenizerPool

    pool = TokenizerPool(llm.model, 64, workers=1, tokenizer=llm.tokenizer_dir)
    time.sleep(after)
    pool.shutdown(grace=0.0)  # (the worker is killed mid-start)
    assert not pool.workers[0].thread.is_alive()
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
