"""`compiled`: the layers' torch definitions through torch.compile where the engine's kernel table asks for it
(`Ops.compile`, minivllm/kernels: on a GPU for what our kernels do not cover, and everywhere with the `compile`
kernel option). The torch.compile wrapper is made on the first call that compiles: making it imports dynamo and
inductor (~2 s), which a run that never compiles does not pay."""

import functools

import torch

from minivllm.utils.context import get_context


def compiled(fn):
    """Decorator: `fn(self, x, ...)` runs through torch.compile when the step's kernel table says so."""
    # Only the token dimension is symbolic (marked dynamic at each call, so the first compile already covers
    # every token count: no static compile for the warm-up's shape followed by a recompile in the first run).
    # dynamic=True would make every dimension symbolic, hidden sizes too, and the generated kernels were
    # 5-10x slower on the H200.
    fast = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal fast
        if not get_context().ops.compile:
            return fn(*args, **kwargs)
        fast = fast or torch.compile(fn)
        for a in args:  # dim 0 is the token count everywhere: compile once for any count (not first for one)
            if isinstance(a, torch.Tensor) and a.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return fast(*args, **kwargs)

    return wrapper
