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
the API server is gone, removes the directory of their IPC sockets (which the API server removes otherwise)."""

import os
import shutil
import signal

import torch
import zmq

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.request import EngineOutput
from minivllm.engine.tp_workers import CORE, set_process_name
from minivllm.frontend.engine_args import config_args
from minivllm.frontend.sampling_extras import SamplingExtras
from minivllm.serve import messages as m

POLL_MS = 200  # idle: how often to look whether the API server is still there


class EngineCore:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.stopping = False

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


def run_engine_core(model: str, engine_args: dict, input_address: str, output_address: str, parent_pid: int) -> None:
    """The core process's entry point (multiprocessing spawns it, core_client.py)."""
    set_process_name(CORE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API server leads the exit
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # on CPU the model's threads would take every core, and the API server's own work (SSE for every
        # stream) would preempt one of them at each step: leave it a core, as vLLM's CPU backend reserves one
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inp.setsockopt(zmq.RCVHWM, 0)
    out.setsockopt(zmq.SNDHWM, 0)  # no limit: the core never waits for the API server to read
    inp.connect(input_address)
    out.connect(output_address)
    enc, dec = m.encoder(), m.decoder(m.ToCore)
    try:
        engine = LLMEngine(model, sampling_hook=SamplingExtras, **config_args(engine_args))
    except BaseException as e:
        out.send(enc.encode(m.Ready(error=f"{type(e).__name__}: {e}")))
        out.close(linger=5000)
        ctx.term()
        return
    core = EngineCore(engine)
    signal.signal(signal.SIGTERM, lambda *_: setattr(core, "stopping", True))
    c = engine.config
    ready = m.Ready(None, c.model, c.max_model_len, c.kvcache_block_size, c.num_kvcache_blocks, engine.vocab_size)
    ready.eos_token_ids, ready.seed, ready.tensor_parallel_size = list(engine.eos), c.seed, c.tensor_parallel_size
    ready.tokenizer = c.tokenizer or c.model
    out.send(enc.encode(ready))
    try:
        loop(core, inp, out, enc, dec, parent_pid)
    finally:
        engine.exit()
        inp.close(linger=0)
        out.close(linger=0 if os.getppid() != parent_pid else 2000)
        ctx.term()
        if os.getppid() != parent_pid:  # the API server died (killed): nobody else removes the sockets' directory
            shutil.rmtree(os.path.dirname(input_address.removeprefix("ipc://")), ignore_errors=True)


def loop(core: EngineCore, inp: zmq.Socket, out: zmq.Socket, enc, dec, parent_pid: int) -> None:
    engine = core.engine
    while not core.stopping:
        if os.getppid() != parent_pid:  # the API server died: nobody to serve
            return
        busy = engine.has_unfinished_requests()
        outputs: list[EngineOutput] = []
        refused: list[tuple[str, str]] = []
        utility = None
        if inp.poll(0 if busy else POLL_MS):
            while True:  # every message that came meanwhile, then one step
                try:
                    msg = dec.decode(inp.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, m.AddRequest):
                    refusal = core.add(msg)
                    refused += [refusal] if refusal is not None else []
                elif isinstance(msg, m.Abort):
                    outputs += core.abort(msg.request_ids)
                elif isinstance(msg, m.AbortAll):
                    outputs += core.abort(list(engine.requests))
                elif isinstance(msg, m.FinishSequences):
                    engine.finish_sequences(msg.targets)
                elif isinstance(msg, m.Utility):
                    utility = (msg.call_id, bool(getattr(core, msg.name)()))
                else:  # Shutdown
                    core.stopping = True
                    break
        if core.stopping:
            outputs += core.abort(list(engine.requests))
        elif engine.has_unfinished_requests():
            outputs += core.step()
        if outputs or refused or utility is not None:
            out.send(enc.encode(m.StepOutputs(outputs, core.stats(), utility, refused)))
