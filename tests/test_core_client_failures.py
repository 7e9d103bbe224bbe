"""The engine-core client (serve/core_client.py) on a stand-in core: a request the engine fails ends its stream with
RequestFailedError carrying the engine's message, a request it refuses with ValueError, while a request beside
them streams to its end; and a core that ends fails what is still open with EngineDeadError. The stand-in runs on a
thread of this process over the real ZMQ sockets and messages; its "process" ends when the thread does."""

import asyncio
import os
import tempfile
import threading

import pytest
import zmq

from minivllm import SamplingParams
from minivllm.engine.request import EngineOutput
from minivllm.sampling_params import RequestOutputKind
from minivllm.serve import messages as m
from minivllm.serve.core_client import AsyncMPClient
from minivllm.serve.core_process import CoreSockets

MESSAGE = "the engine failed this request"
STATS = m.SchedulerStats(0, 0, 0.0, 0)


class ThreadCore(CoreSockets):
    """A core that answers each request at once: "bad-*" failed by the engine, "refused-*" not queued, "hang-*"
    never answered, any other finished after one token. Its sentinel is readable once the thread has ended."""

    owned = True

    def __init__(self, ipc_dir: str, ready: m.Ready) -> None:
        super().__init__(ipc_dir, 0)
        self.sentinel, self.alive_w = os.pipe()
        addresses = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (self.input, self.output)]
        self.thread = threading.Thread(target=self.serve, args=(*addresses, ready), daemon=True)
        self.thread.start()

    def serve(self, inp: str, out: str, ready: m.Ready) -> None:
        ctx = zmq.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.connect(inp)
        push.connect(out)
        enc, dec = m.encoder(), m.decoder(m.ToCore)
        push.send(enc.encode(ready))
        try:
            while True:
                msg = dec.decode(pull.recv())
                if isinstance(msg, (m.Shutdown, m.Utility)):  # (the test's "end now")
                    return
                if not isinstance(msg, m.AddRequest):
                    continue
                rid = msg.request_id
                if rid.startswith("refused"):
                    push.send(enc.encode(m.StepOutputs([], STATS, refused=[(rid, "no room for it")])))
                elif rid.startswith("bad"):
                    push.send(enc.encode(m.StepOutputs([EngineOutput(rid, 0, [], "error", MESSAGE)], STATS)))
                elif not rid.startswith("hang"):
                    push.send(enc.encode(m.StepOutputs([EngineOutput(rid, 0, [7], "length")], STATS)))
        finally:
            pull.close(linger=0)
            push.close(linger=0)
            ctx.term()
            os.close(self.alive_w)  # the sentinel turns readable: the "process" ended

    def stop(self, timeout: float = 60) -> None:
        self.thread.join(timeout)

    def close(self) -> None:
        super().close()
        os.close(self.sentinel)


@pytest.fixture
def client(tiny_qwen3):
    ipc = tempfile.mkdtemp(prefix="minivllm-test-core-")
    ready = m.Ready(None, tiny_qwen3, 256, 16, 64, 512, [0], None, 1, tiny_qwen3)
    client = AsyncMPClient(tiny_qwen3, core=ThreadCore(ipc, ready))
    yield client
    client.shutdown(timeout=10)


async def collect(client: AsyncMPClient, rid: str) -> list | BaseException:
    sp = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.DELTA)
    try:
        return [o async for o in client.generate({"prompt_token_ids": [1, 2, 3]}, sp, rid)]
    except Exception as e:
        return e


def test_a_failed_and_a_refused_request_end_alone(client):
    async def main():
        return await asyncio.gather(*(collect(client, rid) for rid in ("bad-1", "good-1", "refused-1", "good-2")))

    bad, good1, refused, good2 = asyncio.run(main())
    assert isinstance(bad, m.RequestFailedError) and str(bad) == MESSAGE
    assert isinstance(refused, ValueError) and "no room for it" in str(refused)
    for good in (good1, good2):
        assert [o.outputs[0].token_ids for o in good] == [[7]] and good[-1].finished
    assert client.streams == {} and client.output_processor.requests == {}  # nothing left behind
    assert client.is_running


def test_a_core_that_ends_fails_the_open_streams(client):
    async def main():
        hung = asyncio.ensure_future(collect(client, "hang-1"))
        while "hang-1" not in client.streams:
            await asyncio.sleep(0.01)
        with client.lock:
            client.core.send(m.Utility(0, "end"))  # the stand-in ends, as a crashed core would
        return await asyncio.wait_for(hung, 30)

    error = asyncio.run(main())
    assert isinstance(error, m.EngineDeadError) and not client.is_running
