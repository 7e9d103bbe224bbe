"""The server over the engine core in its own process (serve/core.py, core_client.py), as `minivllm serve` runs
it, on a tiny model with the real `openai` client: outputs equal the offline LLM's (greedy, n > 1 seeded, stop
strings, logprobs), /metrics /tokenize /detokenize /version answer as vLLM's, /health answers at once while a
5 MB prompt is tokenised, 256 concurrent streams all complete with offline tokens, 50 clients that disconnect
mid-stream leave no block behind (a request needing the whole KV cache runs after them), and a core killed
mid-load ends every stream with an error within seconds, turns /health to 503 and leaves no process behind."""

import asyncio
import bisect
import json
import os
import signal
import time

import httpx
import openai
import psutil
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.tp_workers import free_port
from minivllm.serve.async_llm import AsyncLLM
from minivllm.serve.core_client import AsyncMPClient
from minivllm.serve.openai_server import ServerThread

BLOCK, BLOCKS = 16, 32
ARGS = dict(kvcache_block_size=BLOCK, max_model_len=BLOCK * BLOCKS, max_num_seqs=64, max_num_batched_tokens=512)
NAME = "tiny"
_gen = torch.Generator().manual_seed(5)
IDS = [torch.randint(1, 512, (int(n),), generator=_gen).tolist() for n in torch.randint(3, 40, (256,), generator=_gen)]
CONVERSATION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def offline(chat_model):
    llm = LLM(chat_model, num_kvcache_blocks=BLOCKS, **ARGS)
    yield llm
    llm.exit()


@pytest.fixture(scope="module")
def server(chat_model):
    llm = AsyncLLM(chat_model, multiprocess=True, num_kvcache_blocks=BLOCKS, **ARGS)
    assert isinstance(llm, AsyncMPClient) and llm.core.process.pid != os.getpid()
    with ServerThread(llm, NAME) as srv:
        srv.llm = llm
        yield srv
    llm.shutdown()
    assert not llm.core.process.is_alive()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{**dict(temperature=0, max_tokens=8, ignore_eos=True), **kw})


def metrics(url: str) -> dict[str, float]:
    """The /metrics samples as {name{labels}: value}."""
    text = httpx.get(url + "/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def idle(url: str, timeout: float = 30) -> None:
    """Wait until the core holds no request and no KV block (a leaked block would keep the usage above 0)."""
    deadline = time.time() + timeout
    while True:
        m = metrics(url)
        gauges = [v for k, v in m.items() if k.startswith(("vllm:num_requests_", "vllm:kv_cache_usage_perc"))]
        if len(gauges) == 3 and not any(gauges):
            return
        assert time.time() < deadline, f"the core did not go idle: {gauges}"
        time.sleep(0.05)


def test_outputs_equal_offline_generate(client, offline):
    extra = dict(ignore_eos=True, return_tokens_as_token_ids=True)
    r = client.completions.create(model=NAME, prompt=IDS[:3], max_tokens=8, temperature=0, logprobs=2, extra_body=extra)
    ref = offline.generate(IDS[:3], greedy(logprobs=2), use_tqdm=False)
    assert [c.text for c in r.choices] == [o.text for o in ref]
    assert [[int(t.split(":")[1]) for t in c.logprobs.tokens] for c in r.choices] == [o.token_ids for o in ref]
    for c, o in zip(r.choices, ref):
        expected = [step[t].logprob for t, step in zip(o.token_ids, o.outputs[0].logprobs)]
        assert c.logprobs.token_logprobs == pytest.approx(expected)
    two = client.completions.create(model=NAME, prompt="Paris is", max_tokens=6, n=3, seed=3, temperature=1.0)
    ref = offline.generate("Paris is", SamplingParams(n=3, seed=3, max_tokens=6), use_tqdm=False)
    assert [c.text for c in two.choices] == [c.text for c in ref[0].outputs]
    chat = client.chat.completions.create(model=NAME, messages=CONVERSATION, max_tokens=8, temperature=0)
    assert (
        chat.choices[0].message.content == offline.chat(CONVERSATION, greedy(ignore_eos=False), use_tqdm=False)[0].text
    )


def test_stop_strings_are_found_by_the_front_end(client, offline):
    (full,) = offline.generate([IDS[7]], greedy(max_tokens=30), use_tqdm=False)
    stop = full.text[10:13]
    (ref,) = offline.generate([IDS[7]], greedy(max_tokens=30, stop=[stop]), use_tqdm=False)
    assert ref.finish_reason == "stop" and len(ref.token_ids) < 30
    for stream in (False, True):
        r = client.completions.create(
            model=NAME,
            prompt=IDS[7],
            max_tokens=30,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body=dict(ignore_eos=True),
        )
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_metrics_tokenize_detokenize_version(server, client, offline):
    before = metrics(server.url)
    key = 'vllm:request_success_total{finished_reason="length",model_name="tiny"}'
    chunks = list(
        client.completions.create(
            model=NAME, prompt=IDS[3], max_tokens=5, temperature=0, stream=True, extra_body=dict(ignore_eos=True)
        )
    )
    after = metrics(server.url)
    assert after[key] == before.get(key, 0) + 1
    assert (
        after['vllm:generation_tokens_total{model_name="tiny"}']
        >= before.get('vllm:generation_tokens_total{model_name="tiny"}', 0) + 5
    )
    assert after['vllm:prompt_tokens_total{model_name="tiny"}'] >= len(IDS[3])
    # a gap between two outputs only where the stream came in two or more pieces: a reader that is behind gets
    # the five tokens merged into one output (RequestOutputCollector), which has no inter-token gap to observe
    families = ["time_to_first_token_seconds", "e2e_request_latency_seconds"]
    families += (
        ["inter_token_latency_seconds"] if len([c for c in chunks if c.choices and c.choices[0].text]) > 1 else []
    )
    for family in families:
        assert after[f'vllm:{family}_count{{model_name="tiny"}}'] > before.get(
            f'vllm:{family}_count{{model_name="tiny"}}', 0
        )
    tok = offline.get_tokenizer()
    r = httpx.post(server.url + "/tokenize", json=dict(model=NAME, prompt="The quick brown fox")).json()
    assert r["tokens"] == tok.encode("The quick brown fox") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == ARGS["max_model_len"]
    chat = httpx.post(server.url + "/tokenize", json=dict(messages=CONVERSATION)).json()
    assert chat["tokens"] == offline.chat(CONVERSATION, greedy(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    assert httpx.post(server.url + "/detokenize", json=dict(tokens=r["tokens"])).json() == {
        "prompt": "The quick brown fox"
    }
    assert httpx.post(server.url + "/tokenize", json=dict(model="nope", prompt="x")).status_code == 404
    assert httpx.get(server.url + "/version").json()["version"]


@pytest.mark.slow
def test_health_answers_while_a_5mb_prompt_is_tokenised(server):
    prompt = "hello world, this is a test. " * 180_000  # 5.2 MB
    with httpx.Client(timeout=120) as h:
        big = httpx.AsyncClient(timeout=120)

        async def main():
            task = asyncio.create_task(big.post(server.url + "/v1/completions", json=dict(model=NAME, prompt=prompt)))
            await asyncio.sleep(0.5)  # it is being tokenised now
            return task

        loop = asyncio.new_event_loop()
        task = loop.run_until_complete(main())
        worst, n = 0.0, 0
        while not task.done():
            t = time.perf_counter()
            assert h.get(server.url + "/health").status_code == 200
            worst, n = max(worst, time.perf_counter() - t), n + 1
            loop.run_until_complete(asyncio.sleep(0.1))
        r = task.result()
        loop.run_until_complete(big.aclose())
        loop.close()
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    assert n >= 3 and worst < 0.5, (n, worst)


async def stream_tokens(aclient, prompt, max_tokens: int) -> list[int]:
    stream = await aclient.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        logprobs=0,
        extra_body=dict(ignore_eos=True, return_tokens_as_token_ids=True),
    )
    tokens, finish = [], None
    async for chunk in stream:
        tokens += [int(t.split(":")[1]) for t in chunk.choices[0].logprobs.tokens]
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    return tokens


@pytest.mark.slow
def test_256_concurrent_streams_complete_with_offline_tokens(server, offline):
    max_tokens = [2 + (5 * i) % 11 for i in range(256)]

    async def main() -> list[list[int]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        http = httpx.AsyncClient(limits=limits, timeout=300)
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, http_client=http)
        try:
            return await asyncio.gather(*[stream_tokens(aclient, IDS[i], max_tokens[i]) for i in range(256)])
        finally:
            await aclient.close()

    got = asyncio.run(main())
    ref = offline.generate(IDS, [greedy(max_tokens=n) for n in max_tokens], use_tqdm=False)
    assert got == [o.token_ids for o in ref]
    assert metrics(server.url)['vllm:num_preemptions_total{model_name="tiny"}'] > 0  # the cache ran full
    idle(server.url)


@pytest.mark.slow
def test_50_disconnects_leave_no_block_behind(server, offline):
    async def leave(http: httpx.AsyncClient, i: int) -> None:
        body = dict(model=NAME, prompt=IDS[i], max_tokens=300, temperature=0, stream=True, ignore_eos=True)
        async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return  # mid-stream: the connection closes here

    async def main() -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits, timeout=120) as http:
            await asyncio.gather(*[leave(http, i) for i in range(50)])

    asyncio.run(main())
    idle(server.url)
    whole = IDS[0] * (BLOCK * BLOCKS // len(IDS[0]))
    whole = whole[: BLOCK * BLOCKS - 8]  # + 8 output tokens: every block of the cache
    r = httpx.post(
        server.url + "/v1/completions",
        json=dict(model=NAME, prompt=whole, max_tokens=8, temperature=0, ignore_eos=True),
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert r.json()["choices"][0]["text"] == offline.generate([whole], greedy(), use_tqdm=False)[0].text
    idle(server.url)


@pytest.mark.slow
def test_a_killed_core_ends_every_stream_and_health_turns_503(chat_model):
    llm = AsyncLLM(chat_model, multiprocess=True, num_kvcache_blocks=BLOCKS, **ARGS)
    core = psutil.Process(llm.core.process.pid)
    with ServerThread(llm, NAME) as server:

        async def one(http: httpx.AsyncClient, i: int, started: asyncio.Event) -> tuple[list, float]:
            body = dict(model=NAME, prompt=IDS[i], max_tokens=400, temperature=0, stream=True, ignore_eos=True)
            events = []
            async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
            return events, time.monotonic()

        async def main():
            # the core dies as soon as every stream has its first chunk: 400 tokens later (under a second for
            # this model on a GPU) none of them has finished
            started = [asyncio.Event() for _ in range(8)]
            async with httpx.AsyncClient(timeout=60) as http:
                tasks = [asyncio.create_task(one(http, i, started[i])) for i in range(8)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                killed = time.monotonic()
                os.kill(core.pid, signal.SIGKILL)
                return killed, await asyncio.gather(*tasks)

        killed, results = asyncio.run(main())
        for events, ended in results:
            assert ended - killed < 5
            assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(server.url + "/v1/completions", json=dict(model=NAME, prompt="hi"), timeout=30)
        assert r.status_code == 500 and "not running" in r.json()["error"]["message"]
    llm.shutdown()
    assert not psutil.pid_exists(core.pid) or core.status() == psutil.STATUS_ZOMBIE
    assert not [p for p in psutil.Process().children(recursive=True) if p.pid == core.pid]


@pytest.mark.slow
def test_sigterm_under_load_stops_every_process(chat_model):
    """`minivllm serve` (core process, tokenizer workers) with 64 open streams: SIGTERM ends each stream with
    "abort" and the server exits 0, leaving no process (a signal landing while the event loop held the client's
    lock once hung it)."""
    from test_server import start_server

    port = free_port()
    proc = start_server(chat_model, port)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 2  # the engine core and the tokenizer workers

    async def one(http: httpx.AsyncClient, i: int, started: asyncio.Event) -> list[str]:
        body = dict(model=chat_model, prompt=IDS[i], max_tokens=400, temperature=0, stream=True, ignore_eos=True)
        events = []
        async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
        return events

    async def main():
        started = asyncio.Event()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            tasks = [asyncio.create_task(one(http, i, started)) for i in range(64)]
            await asyncio.wait_for(started.wait(), 60)
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    for events in results:
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    deadline = time.time() + 15
    while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        assert time.time() < deadline, "a process outlived the server"
        time.sleep(0.1)


def test_metrics_observe_every_output_of_a_stream():
    """A request's meter (ServerMetrics.request) fed a stream of three outputs (2 + 1 + 2 tokens, the last
    finishing): one first-token time, two inter-token gaps, one end-to-end latency, 5 generation tokens and one
    success by finish reason."""
    from types import SimpleNamespace

    from minivllm.frontend.outputs import CompletionOutput, RequestOutput
    from minivllm.serve.metrics import ServerMetrics

    stats = SimpleNamespace(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_preemptions=0)
    sm = ServerMetrics(SimpleNamespace(stats=stats), "m")

    def out(ids, finish=None):
        c = CompletionOutput(0, "x" * len(ids), ids, None, None, finish)
        return RequestOutput("r", None, [1, 2, 3], [c], finish is not None)

    async def stream():
        for o in (out([5, 6]), out([7]), out([8, 9], "length")):
            await asyncio.sleep(0.01)
            yield o

    async def consume(streaming):
        meter, seen = sm.request(streaming), []
        async for o in stream():
            meter(o)  # as the server calls it, with each output as it passes
            seen.append(o)
        return seen

    assert len(asyncio.run(consume(True))) == 3
    text = sm.render().decode()
    for line in (
        'vllm:time_to_first_token_seconds_count{model_name="m"} 1.0',
        'vllm:inter_token_latency_seconds_count{model_name="m"} 2.0',
        'vllm:e2e_request_latency_seconds_count{model_name="m"} 1.0',
        'vllm:generation_tokens_total{model_name="m"} 5.0',
        'vllm:prompt_tokens_total{model_name="m"} 3.0',
        'vllm:request_success_total{finished_reason="length",model_name="m"} 1.0',
    ):
        assert line in text, f"{line!r} not in /metrics"
    asyncio.run(consume(False))  # a request answered in one piece: no first-token or inter-token time
    text = sm.render().decode()
    assert 'vllm:time_to_first_token_seconds_count{model_name="m"} 1.0' in text
    assert 'vllm:e2e_request_latency_seconds_count{model_name="m"} 2.0' in text


def test_metrics_gathered_per_request_reach_prometheus_as_observed_one_by_one(monkeypatch):
    """A meter gathers its generation tokens and inter-token gaps and hands them to Prometheus at most every
    FLUSH_S and when its stream ends: the histogram (buckets, +Inf, sum) and the counter read as if every output
    had been observed on its own; a stream that leaves before its final output (a client gone) is counted when
    its meter is closed; and a long stream's counts reach Prometheus while it runs."""
    from types import SimpleNamespace

    from minivllm.frontend.outputs import CompletionOutput, RequestOutput
    from minivllm.serve import metrics as metrics_module
    from minivllm.serve.metrics import ITL_BUCKETS, ServerMetrics

    stats = SimpleNamespace(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_preemptions=0)
    llm = SimpleNamespace(stats=stats)
    gaps = [0.004, 0.01, 0.0100001, 0.3, 0.31, 25.0, 25.0, 1.0]  # bucket edges, between them, past the last (+Inf)
    bulk, one_by_one = ServerMetrics(llm, "m"), ServerMetrics(llm, "m")
    counts = [0] * len(bulk.itl_bounds)
    for g in gaps:
        counts[bisect.bisect_left(bulk.itl_bounds, g)] += 1
        one_by_one.itl.observe(g)
    bulk.observe_many(bulk.itl, counts, sum(gaps))
    lines = lambda sm: sm.render().decode().splitlines()
    hist = lambda sm: [line for line in lines(sm) if "inter_token" in line and "created" not in line]
    assert hist(bulk) == hist(one_by_one) and len(ITL_BUCKETS) + 3 <= len(hist(bulk))

    clock = [100.0]
    out = lambda ids, finish=None: RequestOutput(
        "r", None, [1, 2], [CompletionOutput(0, "x", ids, None, None, finish)], finish is not None
    )
    text = lambda sm: sm.render().decode()
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    sm = ServerMetrics(llm, "m")
    meter = sm.request(True)
    for step in range(4):  # 0.1 s apart: inside one flush interval
        clock[0] += 0.1
        meter(out([step]))
    assert 'vllm:generation_tokens_total{model_name="m"} 0.0' in text(sm)  # gathered, not yet counted
    meter.close()  # the client left: no final output
    assert 'vllm:generation_tokens_total{model_name="m"} 4.0' in text(sm)
    assert 'vllm:inter_token_latency_seconds_count{model_name="m"} 3.0' in text(sm)
    assert 'vllm:inter_token_latency_seconds_bucket{le="0.15",model_name="m"} 3.0' in text(sm)

    long = sm.request(True)
    for step in range(12):  # 6 s of 0.5 s steps: counted as it runs
        clock[0] += 0.5
        long(out([step]))
    assert 'vllm:generation_tokens_total{model_name="m"} 16.0' in text(sm)


def test_the_engine_processes_are_named(server):
    """`ps` and `top` (and bench_serve.py's CPU accounting) tell the engine core and the tokenizer workers apart."""
    core = psutil.Process(server.llm.core.process.pid)
    assert core.name() == "minivllm-core"
    assert core.ppid() == os.getpid()
    httpx.post(server.url + "/tokenize", json=dict(prompt="hello"))  # the tokenizer pool's workers are up
    names = [p.name() for p in psutil.Process().children(recursive=True)]
    assert "minivllm-tok" in names, names


@pytest.mark.parametrize("chat", [False, True])
def test_chunk_template_writes_the_dict_paths_json(chat):
    """The streaming fast path (sse.ChunkTemplate: the head encoded once, bytes around each text) writes the same
    event as encoding the chunk's dict, for any text, finish reason and stop reason."""
    from minivllm.serve.sse import ChunkTemplate, sse

    head = dict(id="cmpl-1", object="chat.completion.chunk" if chat else "text_completion", created=7, model='m"1')
    template = ChunkTemplate(head, chat)
    for index, text, finish, stop in [
        (0, "", None, None),
        (3, ' "quoted" \\ é 中 \n\t\u2028', None, None),
        (1, "end", "stop", 42),
        (2, "", "stop", "</s>"),
        (0, "x", "length", None),
    ]:
        body = dict(delta=dict(content=text)) if chat else dict(text=text)
        choice = dict(index=index, **body, logprobs=None, finish_reason=finish, stop_reason=stop)
        assert template.event(index, text, finish, stop) == sse(dict(**head, choices=[choice]))
