"""One switch for torch.compile on the small elementwise ops (RMSNorm, RoPE, SiluAndMul, Sampler).

nano-vllm decorates them with @torch.compile. We do the same through `compiled`, which decides at call
time: compile when the input lives on CUDA (where fusion pays), run eagerly on CPU (where inductor's C++
build costs more than it saves in a short test). `set_compile(True/False)` or MINIVLLM_COMPILE=1/0
forces either way; `set_compile(None)` restores the automatic choice."""
import functools
import os

import torch

_override: bool | None = {"1": True, "0": False}.get(os.environ.get("MINIVLLM_COMPILE", ""))


def set_compile(enabled: bool | None) -> None:
    global _override
    _override = enabled


def compile_enabled(x: torch.Tensor) -> bool:
    return _override if _override is not None else x.is_cuda


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
