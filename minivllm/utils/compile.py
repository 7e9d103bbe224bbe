"""How the small elementwise ops (RMSNorm, add+RMSNorm, SiluAndMul, RoPE) run on each device.

- CUDA: our Triton kernels for the norms and SiLU-mul (`runs_triton`), one program per row, compiled once for
  any token count and cached on disk by Triton. nano-vllm uses @torch.compile here; its kernels are no faster
  on the H200, and every process pays dynamo's import and tracing at start (~2-3 s with a warm cache, ~2 s of
  inductor per function without): benchmarks/NOTES.md, part II. The `compile` switch (`utils/switches.py`,
  MINIVLLM_COMPILE=1) brings torch.compile back, everywhere, CPU included; MINIVLLM_COMPILE=0 runs eager torch.
- CPU: eager torch (inductor's C++ build would cost more than it saves in a short run); the `triton_on_cpu`
  switch runs the Triton kernels through the interpreter instead.

`compiled` decorates the torch functions: torch.compile when `compile_enabled(x)` (the switch on, or RoPE's
unfused path on CUDA). The torch.compile wrapper is made on the first call that compiles: making it imports
dynamo and inductor (~2 s), which a run that never compiles does not pay."""

import functools

import torch

from minivllm.utils.switches import SWITCHES, triton_runs_on


def runs_triton(x: torch.Tensor) -> bool:
    """The norms and SiLU-mul run our Triton kernels: on CUDA (or CPU with `triton_on_cpu`), unless the
    `compile` switch is set (True: torch.compile, False: eager torch)."""
    return SWITCHES.compile is None and triton_runs_on(x)


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
