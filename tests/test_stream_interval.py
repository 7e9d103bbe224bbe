"""`--stream-interval N` (vLLM's): after a stream's first output, its reader is woken once N tokens wait, the request
finished or failed; each event then carries N tokens' text, and the whole text is the same as with N = 1."""

import asyncio
import json
import time

import httpx
import pytest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.frontend.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind
from minivllm.serve.async_llm import AsyncLLM
from minivllm.serve.cli import serve_main
from minivllm.serve.openai_server import ServerThread
from minivllm.serve.output_collector import RequestOutputCollector

DELTA = RequestOutputKind.DELTA


def delta(token: int, finished: bool = False) -> RequestOutput:
    c = CompletionOutput(0, f"<{token}>", [token], None, None, "length" if finished else None)
    return RequestOutput("r", None, [1], [c], finished)


def taken(interval: int, kind=DELTA, tokens: int = 8) -> list[list[int]]:
    """The outputs a waiting reader takes when `tokens` single-token outputs come one by one (the last finished)."""

    async def run() -> list[list[int]]:
        collector, got = RequestOutputCollector(kind, interval), []

        async def reader():
            while True:
                out = await collector.get()
                got.append([t for c in out.outputs for t in c.token_ids])
                if out.finished:
                    return

        task = asyncio.create_task(reader())
        for t in range(tokens):
            await asyncio.sleep(0)  # the reader waits before each output comes
            collector.put_nowait(delta(t, finished=t == tokens - 1))
            await asyncio.sleep(0)
        await task
        return got

    return asyncio.run(run())


def test_interval_one_wakes_the_reader_for_every_token():
    assert taken(1) == [[t] for t in range(8)]


def test_interval_wakes_at_the_first_token_then_every_n_and_at_the_end():
    assert taken(3) == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert taken(4, tokens=5) == [[0], [1, 2, 3, 4]]


def test_interval_applies_to_delta_streams_only():
    assert taken(3, kind=RequestOutputKind.CUMULATIVE) == [[t] for t in range(8)]  # (each replaces the last)


def test_an_error_wakes_the_reader_at_once():
    async def run():
        collector = RequestOutputCollector(DELTA, 4)
        collector.put_nowait(delta(0))
        await collector.get()  # the first
        collector.put_nowait(delta(1))
        getter = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        assert not getter.done()  # one token of four waits
        collector.put_nowait(RuntimeError("engine died"))
        return await asyncio.wait_for(getter, 5)

    assert isinstance(asyncio.run(run()), RuntimeError)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_interval_is_refused(bad):
    with pytest.raises(ValueError, match="stream_interval"):
        RequestOutputCollector(DELTA, bad)


def test_cli_refuses_a_bad_stream_interval(tiny_qwen3):
    assert serve_main(["--model", tiny_qwen3, "--stream-interval", "0"]) == 2


def events(url: str, max_tokens: int) -> list[dict]:
    body = dict(model="tiny", prompt=[5, 6, 7], max_tokens=max_tokens, stream=True, ignore_eos=True, temperature=0)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_server_streams_the_same_text_in_fewer_events(tiny_qwen3, monkeypatch):
    """The same greedy request through a server of interval 1 and one of interval 4: the same text and finish, and
    with 4 an event for every 4 tokens after the first (with 1, one a token, fewer only where the reader lagged).
    Each engine step takes 20 ms here, so that the reader keeps up: a tiny model's steps come faster than a
    reader in the same process reads, and the deltas it has not read yet go out as one event."""
    step = LLMEngine.step

    def slow_step(self):
        time.sleep(0.02)
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", slow_step)
    texts, counts = {}, {}
    for interval in (1, 4):
        llm = AsyncLLM(tiny_qwen3, stream_interval=interval, kvcache_block_size=16, max_model_len=128)
        try:
            with ServerThread(llm, "tiny") as srv:
                chunks = events(srv.url, 13)
        finally:
            llm.shutdown()
        texts[interval] = "".join(c["choices"][0]["text"] for c in chunks)
        counts[interval] = len(chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert texts[4] == texts[1]
    assert counts[4] <= 1 + 3 + 1 < counts[1]  # the first token, then 12 in fours (the finish may come alone)
