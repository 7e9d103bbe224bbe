"""The engine core in its own process (vLLM V1's EngineCoreProc): the scheduler and the model runner, i.e.
`LLMEngine` stepping, and nothing else. Its loop, between steps, takes every message the API server sent
(add / abort / utility / shutdown, messages.py), then runs one step and sends ONE message with what every
request got in it: new token ids, logprobs, finish reasons, and the scheduler's gauges.

Why a process of its own: in one Python process the engine's steps and the server's HTTP, JSON and SSE work
share one GIL, so at 256 streams each waits for the other (measured on an H200: served 0.10x of offline
`LLM.generate`). Here the core steps while the API server, another process, detokenises and writes the
streams of the step before.

The core does no text work at a request's every step: requests run as FINAL_ONLY without stop strings (the
front end detokenises and finds stop strings, and aborts the request that hit one); each step's new tokens
are read from the sequences, known ones only (the newest may be a placeholder of the step in flight).
The core exits when asked (Shutdown), on SIGTERM, or when the API server that started it is gone; on the
way out it stops the engine and its tensor-parallel workers, and, when the API server is gone, removes the
directory of their IPC sockets (which the API server removes otherwise)."""

import os
import shutil
import signal
from dataclasses import replace

import torch
import zmq

from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import RequestOutputKind
from minivllm.serve import messages as m
from minivllm.utils.process_name import CORE, set_process_name

POLL_MS = 200  # idle: how often to look whether the API server is still there


class EngineCore:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.sent: dict[str, int] = {}  # request id -> output tokens sent so far
        self.scoring: set[str] = set()  # requests whose prompt logprobs are still to be sent
        self.stopping = False

    def add(self, msg: m.AddRequest) -> m.RequestStep | None:
        params = replace(msg.sampling_params(), stop=None, output_kind=RequestOutputKind.FINAL_ONLY)
        try:
            self.engine.add_request(msg.request_id, {"prompt_token_ids": msg.prompt_token_ids}, params)
        except (ValueError, TypeError) as e:  # the front end validated; a duplicate id would still land here
            return m.RequestStep(msg.request_id, [], None, "error", str(e))
        self.sent[msg.request_id] = 0
        if params.prompt_logprobs is not None:
            self.scoring.add(msg.request_id)
        return None

    def abort(self, ids: list[str]) -> list[m.RequestStep]:
        ids = [rid for rid in ids if rid in self.sent]
        self.engine.abort_request(ids)
        for rid in ids:
            del self.sent[rid]
            self.scoring.discard(rid)
        return [m.RequestStep(rid, [], None, "abort") for rid in ids]

    def step(self) -> list[m.RequestStep]:
        """One engine step; what every request got in it."""
        finished = {o.request_id: o for o in self.engine.step()}
        steps = []
        for rid, request in self.engine.requests.items():  # still running: their known new tokens
            seq = request.seqs[0]
            start, end = seq.num_prompt_tokens + self.sent[rid], seq.num_known_tokens
            if end > start:
                lps = seq.logprobs[self.sent[rid] : end - seq.num_prompt_tokens] if seq.logprobs is not None else None
                step = m.RequestStep(rid, seq.token_ids[start:end], _logprobs(lps))
                step.prompt_logprobs = self._prompt_logprobs(rid, request)
                steps.append(step)
                self.sent[rid] = end - seq.num_prompt_tokens
        for rid, output in finished.items():
            c, sent = output.outputs[0], self.sent.pop(rid, 0)
            lps = c.logprobs[sent:] if c.logprobs is not None else None
            step = m.RequestStep(rid, c.token_ids[sent:], _logprobs(lps), c.finish_reason, c.stop_reason)
            step.error_status = 500  # (read only when it failed: finish_reason "error")
            step.prompt_logprobs = self._prompt_logprobs(rid, output)
            self.scoring.discard(rid)
            steps.append(step)
        return steps

    def _prompt_logprobs(self, rid: str, request) -> list | None:
        """The prompt logprobs of `request` (a Request or its RequestOutput), once: with the first step that has
        them all."""
        scored = request.prompt_logprobs
        if rid not in self.scoring or scored is None or len(scored) < len(request.prompt_token_ids):
            return None
        self.scoring.discard(rid)
        return [None] + _logprobs(scored[1:])

    def stats(self) -> m.SchedulerStats:
        s = self.engine.scheduler
        bm = s.block_manager
        usage = 1.0 - bm.num_free_blocks / max(1, len(bm.blocks))
        waiting = len(s.waiting) + len(self.engine.structured_outputs.pending)  # (grammars compiling: waiting too)
        return m.SchedulerStats(len(s.running) + len(s.finishing), waiting, usage, s.num_preemptions)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()


def _logprobs(steps: list | None) -> list | None:
    if steps is None:
        return None
    return [[(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in step.items()] for step in steps]


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
        engine = LLMEngine(model, **engine_args)
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
        steps: list[m.RequestStep] = []
        utility = None
        if inp.poll(0 if busy else POLL_MS):
            while True:  # every message that came meanwhile, then one step
                try:
                    msg = dec.decode(inp.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, m.AddRequest):
                    refused = core.add(msg)
                    steps += [refused] if refused is not None else []
                elif isinstance(msg, m.Abort):
                    steps += core.abort(msg.request_ids)
                elif isinstance(msg, m.AbortAll):
                    steps += core.abort(list(core.sent))
                elif isinstance(msg, m.Utility):
                    utility = (msg.call_id, bool(getattr(core, msg.name)()))
                else:  # Shutdown
                    core.stopping = True
                    break
        if core.stopping:
            steps += core.abort(list(core.sent))
        elif engine.has_unfinished_requests():
            steps += core.step()
        if steps or utility is not None:
            out.send(enc.encode(m.StepOutputs(steps, core.stats(), utility)))
