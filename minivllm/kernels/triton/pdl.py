"""Programmatic dependent launch (PDL, Hopper and later) for our Triton kernels of a decode step.

A CUDA graph runs a decode step as ~270 kernels back to back, most a few microseconds long, and each pays
for its start (launch, the first loads' memory latency) and its tail while the GPU is partly idle. A kernel
launched with PDL may start while the kernel before it still runs. The protocol in each of our kernels:
1. `wait()` first, before reading anything an earlier kernel wrote or writing anything: it returns once
   the previous kernel has finished and its writes are visible. That kernel waited for its own
   predecessor before finishing, so everything earlier is visible too;
2. `launch_dependents()` once the main loop is done: the next kernel's programs may now be placed on the
   SMs our programs leave, and get through their launch while our last programs store their results.
Kernels that are not ours (cuBLAS, inductor's, NCCL's) launch as usual and wait for everything before them.
With the attention prologue, the paged decode and its combine kernel launched this way a decode step is
~10-30 us faster (benchmarks/HISTORY.md). The trigger comes after the main loop, not at the kernel's start, which
would let whole chains of kernels launch ahead and wait on the SMs.

On CPU (the Triton interpreter) and before Hopper the PDL branches are compiled out (PDL=False); the engine's
`pdl` kernel option (minivllm/kernels) turns it off for its kernels."""

from functools import lru_cache

import torch
import triton
import triton.language as tl


@lru_cache(None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(x: torch.Tensor, wanted: bool = True) -> bool:
    """A kernel on `x` launches with PDL: asked for, and `x` on a Hopper or later GPU."""
    return (
        wanted and x.is_cuda and _hopper(x.device.index if x.device.index is not None else torch.cuda.current_device())
    )


def launch_kwargs(x: torch.Tensor, wanted: bool = True) -> dict:
    """Extra launch arguments of a kernel whose PDL constexpr is `enabled(x, wanted)`."""
    return {"launch_pdl": True} if enabled(x, wanted) else {}


@triton.jit
def launch_dependents():
    tl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def wait():
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
