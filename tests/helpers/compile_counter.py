"""Counts what compiles in a stretch of a process's life (bench.py's timed runs, the GPU start-up tests): Triton
kernels (this process's in-memory cache misses), torch.compile graphs, and FlashAttention-4 kernel variants."""

import sys
import threading
import time


class CompileCounter:
    def __init__(self) -> None:
        self.triton = 0
        self.triton_kernels: list[str] = []  # the name of each Triton kernel compiled, in order
        self.triton_seconds: list[float] = []  # and how long each took (a load from the on-disk cache included)
        # and what it was specialised on (Triton's cache key: argument types, alignments, constants): two
        # compiles of one kernel differ here, which says why a second variant was needed
        self.triton_keys: list[str] = []
        self.triton_threads: list[str] = []  # each compile's thread (kernels/startup/triton_compile.py's, or another)
        try:
            from triton.runtime.jit import JITFunction

            original = JITFunction._do_compile

            def counted(fn_self, *args, **kwargs):
                self.triton += 1
                self.triton_kernels.append(getattr(fn_self, "__name__", "?"))
                self.triton_keys.append(str(args[0]) if args else "?")  # _do_compile(key, signature, ...)
                self.triton_threads.append(threading.current_thread().name)
                t = time.perf_counter()
                try:
                    return original(fn_self, *args, **kwargs)
                finally:
                    self.triton_seconds.append(time.perf_counter() - t)

            JITFunction._do_compile = counted
        except (ImportError, AttributeError):
            self.triton = -1  # this Triton has no such hook: not counted

    def snapshot(self) -> dict:
        """{triton, dynamo_graphs, fa4}: counts so far (-1 where not countable, 0 graphs if dynamo never ran)."""
        dynamo = sys.modules.get("torch._dynamo.utils")
        graphs = int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0
        fa4 = -1
        if "flash_attn.cute.interface" in sys.modules:
            cache = getattr(sys.modules["flash_attn.cute.interface"]._flash_attn_fwd, "compile_cache", {})
            fa4 = len(getattr(cache, "cache", cache))  # FlashAttention-4's JITCache keeps its dict in .cache
        return dict(triton=self.triton, dynamo_graphs=graphs, fa4=fa4)

    @staticmethod
    def delta(before: dict, after: dict) -> dict:
        return {k: after[k] - before[k] for k in after}
