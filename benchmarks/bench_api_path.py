"""The API server's CPU per streamed token, without the engine and without the socket: what `bench_serve.py`'s
`cpu_us_per_token_api` measures, less its noise on a small shared machine.

The API server is the real one (`build_app` over `AsyncMPClient`, uvicorn's HTTP protocol, the output thread, on
uvloop as uvicorn runs it, or asyncio's loop with `--loop asyncio`), on a fake engine core and a fake transport:

    this process (measured: time.process_time)                     a child process (not measured)
    uvicorn's HttpToolsProtocol <- the request's bytes             a fake core on the real ZMQ sockets: every
    the app, AsyncMPClient -- AddRequest ------------------------>   `--step-ms` ms one StepOutputs with one
    the output thread <-------- StepOutputs (msgpack) -----------    token for each running request (random
    SSE events -> FakeTransport.write (counts bytes, no system call)  ids), "length" at the last

`--streams` connections at once each send a streamed /v1/completions request of token ids (`--num-requests` in
all, `--output-len` tokens each), as bench_serve.py's client does. Prints the CPU per output token of this process
(everything but the socket's system call, which a real server adds: ~23 us a write on the development VM), the
writes per token (1.0: one event a token; less: the collector merged tokens of a lagging stream, or
`--stream-interval`), and the median of `--repeat` runs.

  python3 benchmarks/bench_api_path.py                     # 64 streams, 256 requests x 64 tokens, 5 runs
  python3 benchmarks/bench_api_path.py --profile out.prof  # one run under cProfile (the event loop's thread)"""

import argparse
import asyncio
import cProfile
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import uvicorn
import uvloop
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers
from minivllm.engine.request import EngineOutput
from minivllm.serve import messages as m
from minivllm.serve.core_client import AsyncMPClient
from minivllm.serve.core_process import CoreSockets
from minivllm.serve.gc_heap import startup_heap_frozen
from minivllm.serve.openai_server import build_app

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def fake_core(inp: str, out: str, vocab: int, step_s: float, ready: bytes) -> None:
    """The engine core's side of the sockets: one StepOutputs per step, one token per running request."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(inp)
    push.connect(out)
    enc, dec = m.encoder(), m.decoder(m.ToCore)
    push.send(ready)
    running: dict[str, int] = {}  # request id -> tokens left
    rng = random.Random(0)
    stats = m.SchedulerStats(0, 0, 0.0, 0)
    while True:
        while pull.poll(0 if running else 100):
            msg = dec.decode(pull.recv())
            if isinstance(msg, m.Shutdown):
                return
            if isinstance(msg, m.AddRequest):
                running[msg.request_id] = msg.sampling_params().max_tokens
            elif isinstance(msg, m.Abort):
                for rid in msg.request_ids:
                    running.pop(rid, None)
        if not running:
            continue
        outputs = []
        for rid in list(running):
            running[rid] -= 1
            done = running[rid] == 0
            outputs.append(EngineOutput(rid, 0, [rng.randrange(vocab)], "length" if done else None))
            if done:
                del running[rid]
        push.send(enc.encode(m.StepOutputs(outputs, stats)))
        time.sleep(step_s)


class FakeCore(CoreSockets):
    owned = True

    def __init__(self, ipc_dir: str, ready: m.Ready, vocab: int, step_s: float) -> None:
        super().__init__(ipc_dir, 0)
        inp, out = (s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (self.input, self.output))
        args = (inp, out, vocab, step_s, m.encoder().encode(ready))
        self.process = mp.get_context("spawn").Process(target=fake_core, args=args, daemon=True)
        self.process.start()
        self.sentinel = self.process.sentinel

    def stop(self, timeout: float = 60) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()


class FakeTransport(asyncio.Transport):
    """What uvicorn writes to, without a socket: counts writes and bytes, sees the response's end."""

    def __init__(self, done: asyncio.Future) -> None:
        super().__init__()
        self.done, self.writes, self.bytes, self.closing = done, 0, 0, False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data) -> None:
        self.writes += 1
        self.bytes += len(data)
        if data.endswith(b"0\r\n\r\n") and not self.done.done():
            self.done.set_result(None)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def thread_cpu(thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


async def run(app, config, args, vocab: int, output_thread) -> dict:
    state = uvicorn.server.ServerState()
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    writes = 0

    async def one(prompt: list[int]) -> None:
        nonlocal writes
        body = json.dumps(dict(prompt=prompt, max_tokens=args.output_len, stream=True, ignore_eos=True)).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        done = asyncio.get_running_loop().create_future()
        transport = FakeTransport(done)
        proto = uvicorn.protocols.http.httptools_impl.HttpToolsProtocol(config=config, server_state=state, app_state={})
        proto.connection_made(transport)
        proto.data_received(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        await done
        writes += transport.writes - 2  # (the response's start and the chunked body's terminator)
        proto.connection_lost(None)

    limit = asyncio.Semaphore(args.streams)

    async def limited(prompt):
        async with limit:
            await one(prompt)

    t0, w0, o0 = time.process_time(), time.perf_counter(), thread_cpu(output_thread)
    await asyncio.gather(*(limited(p) for p in prompts))
    cpu, wall, out = time.process_time() - t0, time.perf_counter() - w0, thread_cpu(output_thread) - o0
    tokens = args.num_requests * args.output_len
    us = lambda seconds: seconds / tokens * 1e6
    return dict(us_per_token=us(cpu), output_thread_us=us(out), writes_per_token=writes / tokens, wall_s=wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=8.0, help="the fake core's step (long enough not to merge)")
    ap.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval")
    loops = ["uvloop", "asyncio"]
    ap.add_argument("--loop", choices=loops, default="uvloop", help="the event loop (uvicorn's default: uvloop)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", help="run once under cProfile, write the stats here")
    args = ap.parse_args()
    from helpers.tiny_model import make_tiny_checkpoint

    cache = os.path.expanduser("~/.cache/minivllm/bench")
    model = make_tiny_checkpoint(os.path.join(cache, "qwen3-api-path"), "qwen3", **TINY)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    ipc = tempfile.mkdtemp(prefix="minivllm-api-path-")
    ready = m.Ready(None, model, 4096, 16, 100_000, vocab, [0], None, 1, model)
    core = FakeCore(ipc, ready, vocab, args.step_ms / 1000)
    client = AsyncMPClient(model, core=core, stream_interval=args.stream_interval)
    app = build_app(client, "bench")
    config = uvicorn.Config(app, log_level="warning")
    config.load()
    loop = uvloop.new_event_loop() if args.loop == "uvloop" else asyncio.new_event_loop()
    try:
        warm = argparse.Namespace(**{**vars(args), "num_requests": min(16, args.num_requests)})
        loop.run_until_complete(run(app, config, warm, vocab, client.thread))  # (imports, first calls)
        with startup_heap_frozen():  # as run_server serves (gc_heap.py)
            measure(loop, app, config, args, vocab, client)
    finally:
        app.state.tokens.shutdown()
        client.shutdown(timeout=10)
        loop.close()
        shutil.rmtree(ipc, ignore_errors=True)


def measure(loop, app, config, args, vocab: int, client) -> None:
    if args.profile:
        prof = cProfile.Profile(time.thread_time)  # this thread's CPU, not its waits for the GIL
        prof.enable()
        result = loop.run_until_complete(run(app, config, args, vocab, client.thread))
        prof.disable()
        prof.dump_stats(args.profile)
        print(result)
        return
    results = []
    for _ in range(args.repeat):
        results.append(loop.run_until_complete(run(app, config, args, vocab, client.thread)))
        print({k: round(v, 2) for k, v in results[-1].items()}, flush=True)
    us = [r["us_per_token"] for r in results]
    print(f"api path: {statistics.median(us):.1f} us/token median of {len(us)} (min {min(us):.1f}, max {max(us):.1f})")


if __name__ == "__main__":
    main()
