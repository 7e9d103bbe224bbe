"""torch.compile on the small elementwise ops (RMSNorm, RoPE, SiluAndMul), as nano-vllm's @torch.compile.

`compiled` decides at call time: compile when the input lives on CUDA (where fusion pays), run eagerly on
CPU (where inductor's C++ build costs more than it saves in a short run). The `compile` switch
(`utils/switches.py`, MINIVLLM_COMPILE=1/0) forces either way."""

import functools

import torch

from minivllm.utils.switches import SWITCHES


def compile_enabled(x: torch.Tensor) -> bool:
    return SWITCHES.compile if SWITCHES.compile is not None else x.is_cuda


def compiled(fn):
    """Decorator: `fn(self_or_x, x, ...)` runs through torch.compile when `compile_enabled(x)`."""
    # dynamic=None (automatic): compiled for the first shape, recompiled once with only the dimensions that
    # changed (the token count) symbolic. dynamic=True would make every dimension symbolic, hidden sizes
    # too, and the generated kernels were 5-10x slower on the H200 (benchmarks/NOTES.md).
    fast = torch.compile(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        x = next(a for a in args if isinstance(a, torch.Tensor))
        return fast(*args, **kwargs) if compile_enabled(x) else fn(*args, **kwargs)

    return wrapper
