"""The start-up heap kept out of the garbage collector's way in the server's own processes (the engine core and each
API server), as vLLM does. By the time a process serves it holds a few hundred thousand objects that live as long as
it does (the modules, the model, the app), and CPython's oldest-generation collection walks every one of them: ~85 ms
for the engine core on the development machine, a pause of every stream at once (in the core, a step; in an API
server, every event). Frozen (`gc.freeze`), they are left out, and a full collection walks only what serving made."""

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Freeze what is alive now for the block's duration. At its end unfreeze, so that the interpreter's last
    collection sees everything again (Triton's extension types report their objects as leaked at exit otherwise)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
