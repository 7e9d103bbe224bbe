"""Requests lost without a trace when the server's event loop stalls longer than uvicorn's keep-alive timeout.

  python3 scripts/serve_stall.py --timeout-keep-alive 5 --stall 7    # requests lost (uvicorn's default: 5 s)
  python3 scripts/serve_stall.py --timeout-keep-alive 60 --stall 7   # none lost (openai_server.TIMEOUT_KEEP_ALIVE)

Why: the engine thread shares the server's GIL; something that holds it for seconds (a kernel compiling) stalls
the event loop. If the loop polled its sockets just before the stall, then when it resumes it first runs the timers
that fell due meanwhile, before polling again. A kept-alive connection whose response completed right before the
stall has its keep-alive timer among them: uvicorn closes the socket while the client's next request, sent during
the stall, sits unread in it; the kernel answers with a reset, the client gets httpx.ReadError (ECONNRESET) waiting
for the response headers, and the server logs nothing.

How: a tiny random Qwen3 in a temporary directory; the real server (`run_server`) in a subprocess of this script,
its uvicorn patched to hold the GIL for --stall seconds (a helper thread, --delay after a response completed) once
per arming: the client creates a file before each level. Streaming /v1/completions at concurrency 4 and 16, each
client worker pausing --think seconds between its requests, so that the next ones reliably arrive during the stall
(a client without pauses, as bench_serve.py, loses requests by chance: 3-36 of 160 in the first reproduction).

It backs benchmarks/RESULTS.md (2026-12-01) and openai_server.TIMEOUT_KEEP_ALIVE.
"""

import argparse
import asyncio
import collections
import ctypes
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def hold_gil(delay: float, secs: int) -> None:
    time.sleep(delay)  # the GIL released: the loop finishes this step's responses and goes back to polling
    ctypes.PyDLL(None).sleep(secs)  # a C call made through PyDLL keeps the GIL held throughout


def serve(args: argparse.Namespace) -> None:
    """The server: run_server, its uvicorn stalling after a response if the file --arm exists (removed: one stall)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from minivllm.serve.openai_server import run_server

    original = H11Protocol.on_response_complete

    def on_response_complete(self: H11Protocol) -> None:
        original(self)  # arms this connection's keep-alive timer
        try:
            os.remove(args.arm)
        except FileNotFoundError:
            return
        threading.Thread(target=hold_gil, args=(args.delay, args.stall), daemon=True).start()

    H11Protocol.on_response_complete = on_response_complete
    server_args = dict(port=int(args.port), served_model_name="tiny", timeout_keep_alive=args.timeout_keep_alive)
    run_server(
        args.serve, log_level="warning", device="cpu", max_model_len=256, cpu_kvcache_bytes=1 << 24, **server_args
    )


async def request(client: httpx.AsyncClient, url: str, rng: random.Random) -> str | None:
    """One streamed completion; None if it succeeded, else the exception's type."""
    body = dict(prompt=[rng.randrange(1, 500) for _ in range(16)], max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        async with client.stream("POST", url, json={"model": "tiny", "stream": True, **body}) as response:
            response.raise_for_status()
            async for _ in response.aiter_lines():
                pass
        return None
    except httpx.HTTPError as e:
        return type(e).__name__


async def worker(client: httpx.AsyncClient, url: str, n: int, think: float, rng: random.Random) -> list[str | None]:
    results = []
    for i in range(n):
        if i:
            await asyncio.sleep(think)
        results.append(await request(client, url, rng))
    return results


async def level(url: str, concurrency: int, per_worker: int, think: float, arm: str | None) -> list[str | None]:
    async with httpx.AsyncClient(timeout=120) as client:  # fresh keep-alive connections for each level
        if arm:
            open(arm, "w").close()  # the server stalls after the next response it completes
        rngs = [random.Random(i) for i in range(concurrency)]
        runs = await asyncio.gather(*(worker(client, url, per_worker, think, r) for r in rngs))
    return [r for run in runs for r in run]


def start_server(args: argparse.Namespace, model: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--serve", model, "--port", str(port), "--stall", str(args.stall)]
    cmd += ["--timeout-keep-alive", str(args.timeout_keep_alive), "--delay", str(args.delay), "--arm", args.arm]
    server = subprocess.Popen(cmd)
    deadline = time.monotonic() + 300
    while server.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.5)
    server.kill()
    sys.exit("the server did not start")


def lost_line(lost: collections.Counter, total: int) -> str:
    kinds = ", ".join(f"{kind}: {n}" for kind, n in lost.most_common())
    return f"{lost.total()} of {total} requests lost" + (f" ({kinds})" if kinds else "")


def run_levels(args: argparse.Namespace, url: str) -> tuple[int, collections.Counter]:
    if any(asyncio.run(level(url, 1, 2, 0, None))):  # warm-up, no stall
        sys.exit("the warm-up requests failed")
    total, lost = 0, collections.Counter()
    for rep in range(args.repeats):
        for c in args.levels:
            start = time.monotonic()
            results = asyncio.run(level(url, c, 4, args.think, args.arm))
            failed = collections.Counter(r for r in results if r)
            total, lost = total + len(results), lost + failed
            took = time.monotonic() - start
            print(f"repeat {rep + 1}, concurrency {c}: {lost_line(failed, len(results))} in {took:.1f} s", flush=True)
    return total, lost


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--timeout-keep-alive", type=float, default=5.0, help="uvicorn's keep-alive timeout, seconds")
    p.add_argument("--stall", type=int, default=7, help="seconds the GIL is held, once per level")
    p.add_argument("--delay", type=float, default=0.1, help="seconds from the response's end to the stall")
    p.add_argument("--think", type=float, default=0.5, help="seconds a client worker waits between its requests")
    p.add_argument("--levels", type=int, nargs="+", default=[4, 16], help="concurrencies (client workers)")
    p.add_argument("--repeats", type=int, default=2, help="times the levels are run")
    for hidden in ("--serve", "--port", "--arm"):  # the server subprocess: model dir, port, file that arms a stall
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(args)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers
    from helpers.tiny_model import make_tiny_checkpoint
    from minivllm.engine.tp_workers import free_port

    with tempfile.TemporaryDirectory() as tmp:
        model, port, args.arm = make_tiny_checkpoint(os.path.join(tmp, "tiny-qwen3")), free_port(), f"{tmp}/arm"
        server = start_server(args, model, port)
        try:
            total, lost = run_levels(args, f"http://127.0.0.1:{port}/v1/completions")
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    print(f"keep-alive {args.timeout_keep_alive:g} s, stall {args.stall} s: {lost_line(lost, total)}")


if __name__ == "__main__":
    main()
