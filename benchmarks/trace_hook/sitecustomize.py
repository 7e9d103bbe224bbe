"""Loaded at the start of every Python process whose PYTHONPATH has this directory first (benchmarks/trace_serve.py
sets it, with TRACE_DIR): in each process that imports the engine, every `LLMEngine.step` is recorded (perf_counter
start and end, the process's rusage changes, the step log's records it completed, whether the engine idles
after it) and, in the serving engine core,
every message's arrival (`EngineCore.apply`); JSON lines to TRACE_DIR/<process name>-<pid>.jsonl, written whenever
the engine idles and at exit. Without TRACE_DIR it does nothing. Not part of the package: a benchmark's probe."""

import atexit
import importlib.abc
import importlib.machinery
import json
import os
import resource
import sys
import time

DIR = os.environ.get("TRACE_DIR")
RECORDS: list[dict] = []


def flush() -> None:
    if not RECORDS:
        return
    try:
        with open("/proc/self/comm") as f:
            name = f.read().strip()
    except OSError:
        name = "python"
    with open(os.path.join(DIR, f"{name}-{os.getpid()}.jsonl"), "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in RECORDS))
    RECORDS.clear()


def trace_engine(module) -> None:
    step = module.LLMEngine.step

    def traced(self):
        r0, t0, n0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), self.step_log.mark()
        out = step(self)
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        done = self.step_log.since(n0)
        idle = not self.has_unfinished_requests()
        RECORDS.append(
            dict(
                kind="step", t0=t0, t1=t1, user=r1.ru_utime - r0.ru_utime, sys=r1.ru_stime - r0.ru_stime,
                faults=r1.ru_minflt - r0.ru_minflt, preempted=r1.ru_nivcsw - r0.ru_nivcsw,
                launches=[[r.is_prefill, r.num_seqs, r.num_tokens, r.run] for r in done], idle=idle,
            )
        )  # fmt: skip
        if idle:
            flush()
        return out

    module.LLMEngine.step = traced


def trace_core(module) -> None:
    apply = module.EngineCore.apply

    def traced(self, msg, client, results):
        RECORDS.append(dict(kind="msg", t=time.perf_counter(), client=client, type=type(msg).__name__))
        return apply(self, msg, client, results)

    module.EngineCore.apply = traced


TRACED = {"minivllm.engine.llm_engine": trace_engine, "minivllm.serve.core": trace_core}


class Finder(importlib.abc.MetaPathFinder):
    """Finds the traced modules as usual, and patches each once it has executed."""

    def find_spec(self, name, path, target=None):
        if name not in TRACED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            TRACED[name](module)

        spec.loader.exec_module = exec_module
        return spec


if DIR:
    os.makedirs(DIR, exist_ok=True)
    sys.meta_path.insert(0, Finder())
    atexit.register(flush)
