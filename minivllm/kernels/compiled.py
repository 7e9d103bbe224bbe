"""The torch definitions through torch.compile: what a GPU engine's layers run where its table has no kernel of
ours (RoPE outside the fused prologue; every small op with the `compile` kernel option on). `Ops.bind` wraps a
definition with `compiled` when the table compiles (kernels/table.py)."""

import functools
from collections.abc import Callable

import torch


@functools.cache
def compiled(fn: Callable, token_args: int = 1) -> Callable:
    """`fn` through torch.compile, made on the first call (making it imports dynamo and inductor, ~2 s, which a run
    that never calls it does not pay). Only the token dimension is symbolic, marked dynamic at each call so the
    first compile covers every token count; every dimension symbolic (dynamic=True) made hidden sizes symbolic
    too, and the generated kernels 5-10x slower on a GPU. One wrapper per definition (cached), shared by every
    layer that binds it: a wrapper per layer would compile the same graph once per layer."""
    fast = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal fast
        fast = fast or torch.compile(fn)
        for a in args[:token_args]:
            if isinstance(a, torch.Tensor) and a.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return fast(*args, **kwargs)

    return wrapper
