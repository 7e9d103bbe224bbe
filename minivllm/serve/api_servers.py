"""Several API-server processes beside one engine core: `minivllm serve --api-server-count N` (vLLM's flag and
design: entrypoints/cli/serve.py's run_multi_api_server, v1/utils.py's APIServerProcessManager).

Why: one API-server process spends tens of microseconds of CPU per output token (HTTP, JSON, SSE, detokenising:
benchmarks/bench_serve.py measures it), so one core of the host caps what it can stream, whatever the GPU. N
processes share the work; the engine core stays one, so the batch stays one.

    parent (this module)              API server i (N of them)                 engine core (core.py)
    --------------------              ------------------------                 ---------------------
    makes the listening socket  ----> accepts connections on it, tokenises,    one scheduler for all:
    starts the core, the API          validates, detokenises, streams its      reads every API server's
    servers; watches them all         own requests  -- AddRequest / Abort -->  messages, sends each its
    SIGTERM: ends the API servers,    <-- its own StepOutputs -------------    own outputs (it knows
    then the core                     (its pair of IPC sockets)                whose each request is)

The socket is made once, here, and handed to each API server (multiprocessing passes its descriptor); the kernel
gives each new connection to one of the processes waiting in accept. Request ids are uuid4s, unique across the
processes; an abort (a client that disconnects) goes from the process that holds the request to the core.
/metrics sums every process's counts (metrics.py, Prometheus multiprocess mode).

Ending: SIGTERM or SIGINT to the parent ends the API servers as SIGTERM ends one (their streams end with
finish_reason "abort"), then the core; the parent exits 0. A dead core: every API server sees it (a pidfd),
ends its open streams with an error and exits 1; the parent exits 1. A dead API server: as vLLM, the parent ends
the others and the core and exits 1 (a supervisor restarts the whole server). Every way out removes the directory
of the IPC sockets and metrics files; the core and the API servers also leave when the parent is killed."""

import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
from multiprocessing.connection import wait

from minivllm.engine.tp_workers import set_process_name
from minivllm.serve.core_process import spawn_core

API_SERVER = "minivllm-api"  # the API-server processes' name in ps / top (bench_serve.py counts them as the API)
MAX_DEFAULT = 4  # API servers by default at most: beyond, the engine core's own CPU is the limit
CORES_PER_API_SERVER = 4  # the default gives one API server per this many cores (the core and the client need theirs)
STOP_TIMEOUT = 20.0  # seconds an API server gets to close its connections (uvicorn's graceful shutdown: 10)


def default_api_server_count(cores: int | None = None) -> int:
    """One API server per 4 CPU cores this process may use, 1 to 4: 1 on a 2-core laptop, 4 on a 16-core GPU host."""
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, min(MAX_DEFAULT, cores // CORES_PER_API_SERVER))


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, as uvicorn would make it (OSError: the address is in use or not available)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's backlog
    except OSError:
        sock.close()
        raise
    return sock


def run_api_server(index: int, sock: socket.socket, ipc_dir: str, core_pid: int, parent_pid: int, serve: dict) -> None:
    """API server `index`'s process: a client of the parent's core, uvicorn on the shared socket."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(ipc_dir, "metrics")  # before prometheus_client loads
    set_process_name(API_SERVER)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent leads the exit
    from minivllm.serve.core_client import AsyncMPClient
    from minivllm.serve.core_process import AttachedCore
    from minivllm.serve.messages import EngineDeadError
    from minivllm.serve.openai_server import run_server

    try:
        core = AttachedCore(ipc_dir, index, core_pid)
        client = AsyncMPClient(serve["model"], core=core, stream_interval=serve.get("stream_interval", 1))
    except (RuntimeError, ProcessLookupError) as e:  # the core could not start, or is gone
        print(f"minivllm serve: error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        run_server(llm=client, sockets=[sock], parent_pid=parent_pid, **serve)
    except EngineDeadError as e:
        print(f"minivllm serve: API server {index}: {e}", file=sys.stderr)
        sys.exit(1)


def run_multi_api_server(sock: socket.socket, count: int, engine_args: dict, serve: dict) -> int:
    """Serve on `sock` with `count` API servers and one engine core until SIGTERM / SIGINT (0) or a process dies
    (1; 2 when an API server could not start). `serve`: run_server's arguments (model, served name, options)."""
    stop: list[int] = []
    previous = {s: signal.signal(s, lambda sig, _: stop.append(sig)) for s in (signal.SIGINT, signal.SIGTERM)}
    ipc_dir = tempfile.mkdtemp(prefix="minivllm-core-")
    os.mkdir(os.path.join(ipc_dir, "metrics"))
    core, servers = None, []
    try:
        core = spawn_core(serve["model"], engine_args, ipc_dir, count)
        ctx = mp.get_context("spawn")
        for i in range(count):
            args = (i, sock, ipc_dir, core.pid, os.getpid(), serve)
            servers.append(ctx.Process(target=run_api_server, args=args, name=f"minivllm-api-server-{i}"))
            servers[-1].start()
        sock.close()  # the API servers hold it now
        return supervise(core, servers, stop)
    finally:
        sock.close()  # (closed already once the API servers started; here too when they could not be started)
        shut_down(core, servers)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)


def supervise(core: mp.Process, servers: list[mp.Process], stop: list[int]) -> int:
    """Wait until a signal asks to stop (0) or a process ends (1, or an API server's own code)."""
    while not stop:
        ended = wait([core.sentinel, *(p.sentinel for p in servers)], timeout=0.2)
        if stop:
            break
        if core.sentinel in ended:  # each API server ends its streams with an error and exits 1 by itself
            core.join(1)
            print(f"minivllm serve: the engine core died (exit code {core.exitcode})", file=sys.stderr)
            for p in servers:
                p.join(STOP_TIMEOUT)
            return 1
        for i, p in enumerate(servers):
            if p.sentinel in ended:
                p.join(1)
                print(f"minivllm serve: API server {i} exited (code {p.exitcode}): stopping", file=sys.stderr)
                return p.exitcode if p.exitcode and p.exitcode > 0 else 1
    return 0


def shut_down(core: mp.Process | None, servers: list[mp.Process]) -> None:
    """The API servers first (SIGTERM: their requests aborted, their connections closed), then the core."""
    for p in servers:
        if p.is_alive():
            p.terminate()
    for p in servers:
        p.join(STOP_TIMEOUT)
        if p.is_alive():
            p.kill()
            p.join(5)
    if core is not None and core.is_alive():
        core.terminate()  # (SIGTERM: the core aborts what is left, stops its TP workers and exits)
        core.join(60)
        if core.is_alive():
            core.kill()
            core.join(5)
