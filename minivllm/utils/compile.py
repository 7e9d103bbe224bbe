"""torch.compile on the small elementwise ops (RMSNorm, RoPE, SiluAndMul), as nano-vllm's @torch.compile.

`compiled` decides at call time: compile when the input lives on CUDA (where fusion pays), run eagerly on
CPU (where inductor's C++ build costs more than it saves in a short run). The `compile` switch
(`utils/switches.py`, MINIVLLM_COMPILE=1/0) forces either way. The torch.compile wrapper is made on the
first call that compiles: making it imports dynamo and inductor (~2 s), which a CPU run never needs."""

import functools

import torch

from minivllm.utils.switches import SWITCHES


def compile_enabled(x: torch.Tensor) -> bool:
    return SWITCHES.compile if SWITCHES.compile is not None else x.is_cuda


def compiled(fn):
    """Decorator: `fn(self_or_x, x, ...)` runs through torch.compile when `compile_enabled(x)`."""
    # Only the token dimension is symbolic (marked dynamic at each call, so the first compile already covers
    # every token count: no static compile for the warm-up's shape followed by a recompile in the first run).
    # dynamic=True would make every dimension symbolic, hidden sizes too, and the generated kernels were
    # 5-10x slower on the H200 (benchmarks/NOTES.md).
    fast = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal fast
        x = next(a for a in args if isinstance(a, torch.Tensor))
        if not compile_enabled(x):
            return fn(*args, **kwargs)
        fast = fast or torch.compile(fn)
        for a in args:  # dim 0 is the token count everywhere: compile once for any count (not first for one)
            if isinstance(a, torch.Tensor) and a.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return fast(*args, **kwargs)

    return wrapper
