"""The garbage collector kept out of the way in the server's own processes (the engine core and each API server).

By the time a process serves it holds a few hundred thousand objects that live as long as it does (the modules, the
model, the app), and CPython's oldest-generation collection walks every one of them: ~85 ms for the engine core on
the development machine, a pause of every stream at once (in the core, a step; in an API server, every event).
Frozen (`gc.freeze`, as vLLM does), they are left out, and a full collection walks only what serving made.

A request then makes thousands of short-lived containers (coroutines, closures, the parsed body), so CPython's
youngest generation (700 allocations) is collected every few requests, each time walking the requests in flight:
~0.1 ms of CPU a request in an API server at 64 streams (`benchmarks/bench_api_path.py --output-len 1`). Serving
collects it every YOUNG_THRESHOLD allocations instead; cycles still go, a little later."""

import gc
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 50_000


@contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Freeze what is alive now, and collect the youngest generation less often, for the block's duration. At its
    end unfreeze, so that the interpreter's last collection sees everything again (Triton's extension types report
    their objects as leaked at exit otherwise), and restore the thresholds."""
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
