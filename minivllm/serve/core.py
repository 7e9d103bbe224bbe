"""The engine core in its own process (vLLM V1's EngineCoreProc): the scheduler and the model runner, i.e.
`LLMEngine` stepping, and nothing else. Its loop, between steps, takes every message the API server sent
(add / abort / utility / shutdown, messages.py), then runs one step and sends ONE message with what every
request got in it: new token ids, logprobs, finish reasons, and the scheduler's gauges.

Why a process of its own: in one Python process the engine's steps and the server's HTTP, JSON and SSE work
share one GIL, so at 256 streams each waits for the other (served 0.10x of offline `LLM.generate`,
benchmarks/RESULTS.md). Here the core steps while the API server, another process, detokenises and writes the
streams of the step before.

The core does no text work: the engine emits token ids (EngineOutput), sent as they are; the API server's
output processor detokenises, finds stop strings (and tells the core to end a sequence that hit one), and makes
the RequestOutputs, with the same code as `LLM`. The core exits when asked (Shutdown), on SIGTERM, or when the
API server that started it is gone; on the way out it stops the engine and its tensor-parallel workers, and, when
the API server is gone, removes the directory of their IPC sockets (which the API server removes otherwise).

With several API-server processes (`--api-server-count N`, api_servers.py) the core has a pair of sockets per API
server: it reads the messages of all of them, remembers whose each request is, and sends each its own outputs
(vLLM's engine core routes by the client index of each request the same way); an AbortAll aborts the sender's
requests only. One API server: one pair, everything to it, no lookup."""

import os
import shutil
import signal

import torch
import zmq

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.request import EngineOutput
from minivllm.engine.tp_workers import set_process_name
from minivllm.frontend.engine_args import config_args
from minivllm.frontend.sampling_extras import SamplingExtras
from minivllm.serve import messages as m
from minivllm.serve.gc_heap import startup_heap_frozen
from minivllm.serve.host_memory import keep_freed_memory

CORE = "minivllm-core"  # the engine core process's name in ps / top (bench_serve.py counts it as the engine)
POLL_MS = 200  # idle: how often to look whether the API server is still there
IDLE = m.SchedulerStats(0, 0, 0.0, 0)  # (replaced by the gauges after the step before a result is sent)


class EngineCore:
    def __init__(self, engine: LLMEngine, num_clients: int = 1) -> None:
        self.engine = engine
        self.stopping = False
        self.owner: dict[str, int] = {}  # request id -> the API server (client) that sent it, with several
        self.seen: list[m.SchedulerStats | None] = [None] * num_clients  # the gauges each client has last seen

    def apply(self, msg, client: int, results: list[m.StepOutputs]) -> bool:
        """Apply one message from API server `client`; its answers go into results[client]. True: Shutdown."""
        if isinstance(msg, m.AddRequest):
            refusal = self.add(msg)
            if refusal is not None:
                results[client].refused.append(refusal)
            elif len(results) > 1:
                self.owner[msg.request_id] = client
        elif isinstance(msg, m.Abort):
            self.route(self.abort(msg.request_ids), results)
        elif isinstance(msg, m.AbortAll):  # the client's own requests (all of them with one client)
            mine = [rid for rid in self.engine.requests if self.owner.get(rid, 0) == client]
            self.route(self.abort(mine), results)
        elif isinstance(msg, m.FinishSequences):
            self.engine.finish_sequences(msg.targets)
            for rid, _ in msg.targets:  # a request whose sequences all ended on a stop string has left
                if rid not in self.engine.requests:
                    self.owner.pop(rid, None)
        elif isinstance(msg, m.Utility):
            results[client].utility = (msg.call_id, bool(getattr(self, msg.name)()))
        else:  # Shutdown
            self.stopping = True
        return self.stopping

    def route(self, outputs: list[EngineOutput], results: list[m.StepOutputs]) -> None:
        """Each output to the API server whose request it is (one client: all to it, no lookup)."""
        if len(results) == 1:
            results[0].outputs += outputs
            return
        for out in outputs:
            client = self.owner.get(out.request_id)
            if client is None:
                continue
            results[client].outputs.append(out)
            if out.finish_reason is not None and out.request_id not in self.engine.requests:
                del self.owner[out.request_id]  # (n > 1: the last of its sequences)

    def stale(self, client: int) -> bool:
        """Several API servers: an idle one still gets the gauges when they change (its /metrics reports them)."""
        return len(self.seen) > 1 and self.seen[client] != self.stats()

    def add(self, msg: m.AddRequest) -> tuple[str, str] | None:
        """Queue a request; (its id, why) when the engine refuses it (the front end validated; a duplicate id
        would still land here)."""
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling_params())
        except (ValueError, TypeError) as e:
            return msg.request_id, str(e)
        return None

    def abort(self, ids: list[str]) -> list[EngineOutput]:
        return self.engine.abort_request(ids)

    def step(self) -> list[EngineOutput]:
        return self.engine.step()

    def stats(self) -> m.SchedulerStats:
        s = self.engine.scheduler
        bm = s.block_manager
        usage = 1.0 - bm.num_free_blocks / max(1, len(bm.blocks))
        hook = self.engine.sampling_hook
        waiting = len(s.waiting) + (hook.num_waiting if hook is not None else 0)  # (grammars compiling: waiting too)
        return m.SchedulerStats(len(s.running) + len(s.finishing), waiting, usage, s.num_preemptions)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()


def cpu_threads(cores: int, api_servers: int) -> int:
    """The model's threads in a core on CPU: at most half the cores, and a core left to each API server. The
    threads of one op wait for each other, so one preempted by an API server's or a client's work (SSE for every
    stream) stalls the whole step, and a small model's step gains little past half of a many-core host's cores
    (benchmarks/RESULTS.md, sets r and s). 1 on a 2-core laptop, 8 of 16 beside 1 to 8 API servers."""
    return max(1, min(cores // 2, cores - api_servers))


def run_engine_core(model: str, engine_args: dict, clients: list[tuple[str, str]], parent_pid: int) -> None:
    """The core process's entry point (multiprocessing spawns it, core_process.py). `clients`: each API server's
    (input, output) socket addresses; one with `minivllm serve`, N with --api-server-count N (api_servers.py)."""
    set_process_name(CORE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API server leads the exit
    if not torch.cuda.is_available():  # the model runs on CPU: its activations are this process's memory
        keep_freed_memory()  # each prefill reuses the last one's activations instead of faulting them in
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(cpu_threads(len(os.sched_getaffinity(0)), api_servers=len(clients)))
    ctx = zmq.Context()
    inputs, outputs = [ctx.socket(zmq.PULL) for _ in clients], [ctx.socket(zmq.PUSH) for _ in clients]
    for inp, out, (input_address, output_address) in zip(inputs, outputs, clients):
        inp.setsockopt(zmq.RCVHWM, 0)
        out.setsockopt(zmq.SNDHWM, 0)  # no limit: the core never waits for an API server to read
        inp.connect(input_address)
        out.connect(output_address)
    enc, dec = m.encoder(), m.decoder(m.ToCore)
    parent_gone = lambda: os.getppid() != parent_pid
    try:
        engine = LLMEngine(model, sampling_hook=SamplingExtras, **config_args(engine_args))
    except BaseException as e:
        for out in outputs:
            out.send(enc.encode(m.Ready(error=f"{type(e).__name__}: {e}")))
            out.close(linger=5000)
        ctx.term()
        return
    core = EngineCore(engine, len(clients))
    signal.signal(signal.SIGTERM, lambda *_: setattr(core, "stopping", True))
    c = engine.config
    ready = m.Ready(None, c.model, c.max_model_len, c.kvcache_block_size, c.num_kvcache_blocks, engine.vocab_size)
    ready.eos_token_ids, ready.seed, ready.tensor_parallel_size = list(engine.eos), c.seed, c.tensor_parallel_size
    ready.tokenizer = c.tokenizer or c.model
    for out in outputs:
        out.send(enc.encode(ready))
    try:
        with startup_heap_frozen():  # (a full collection would pause a step ~0.1 s: gc_heap.py)
            loop(core, inputs, outputs, enc, dec, parent_gone)
    finally:
        engine.exit()
        for sock in inputs + outputs:
            sock.close(linger=0 if parent_gone() else 2000)
        ctx.term()
        if parent_gone():  # the API server died (killed): nobody else removes the sockets' directory
            shutil.rmtree(os.path.dirname(clients[0][0].removeprefix("ipc://")), ignore_errors=True)


def loop(core: EngineCore, inputs: list[zmq.Socket], outputs: list[zmq.Socket], enc, dec, parent_gone) -> None:
    """Between steps: every message any API server sent (client i's on inputs[i]); then one step; then ONE
    message to each API server with something in it (its requests' outputs: the core knows whose each is)."""
    engine = core.engine
    poller = zmq.Poller()
    for inp in inputs:
        poller.register(inp, zmq.POLLIN)
    while not core.stopping:
        if parent_gone():  # the API server (or the process that started the API servers) died: nobody to serve
            return
        busy = engine.has_unfinished_requests()
        results = [m.StepOutputs([], IDLE) for _ in outputs]  # what each API server gets after this step
        for inp, _ in poller.poll(0 if busy else POLL_MS):
            client = inputs.index(inp)
            while True:  # every message that came meanwhile, then one step
                try:
                    msg = dec.decode(inp.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if core.apply(msg, client, results):
                    break  # Shutdown
        if core.stopping:
            core.route(core.abort(list(engine.requests)), results)
        elif engine.has_unfinished_requests():
            core.route(core.step(), results)
        stats = None
        for client, (out, result) in enumerate(zip(outputs, results)):
            if result.outputs or result.refused or result.utility is not None or core.stale(client):
                result.stats = stats = stats or core.stats()
                core.seen[client] = stats
                out.send(enc.encode(result))
