"""Programmatic dependent launch (PDL, Hopper and later) for our Triton kernels of a decode step.

A CUDA graph runs a decode step as ~270 kernels back to back, most a few microseconds long, and each pays
for its start (launch, the first loads' memory latency) and its tail while the GPU is partly idle. A kernel
launched with PDL may start while the kernel before it still runs. The protocol in each of our kernels:
1. `launch_dependents()` first: the next kernel may start as soon as all our programs have begun;
2. read only what no kernel of the step writes (weights: the skinny matmuls prefetch theirs into L2);
3. `wait()` before reading anything an earlier kernel wrote, or writing anything: it returns once the
   previous kernel has finished and its writes are visible. That kernel waited for its own predecessor
   before finishing, so everything earlier is visible too.
Kernels that are not ours (cuBLAS, inductor's, NCCL's) launch as usual and wait for everything before them.

On CPU (the Triton interpreter) and before Hopper the PDL branches are compiled out (PDL=False)."""
import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

_enabled = os.environ.get("MINIVLLM_PDL", "1") != "0"
_late = os.environ.get("MINIVLLM_PDL_TRIGGER", "late") == "late"


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = on


@lru_cache(None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(x: torch.Tensor) -> bool:
    return _enabled and x.is_cuda and _hopper(x.device.index if x.device.index is not None else torch.cuda.current_device())


def mode(x: torch.Tensor) -> int:
    """A kernel's PDL constexpr: 0 off, 1 let the next kernel start at our start, 2 after our main loop."""
    return (2 if _late else 1) if enabled(x) else 0


def set_trigger(late: bool) -> None:
    global _late
    _late = late


def launch_kwargs(x: torch.Tensor) -> dict:
    """Extra launch arguments of a kernel whose PDL constexpr is `enabled(x)`."""
    return {"launch_pdl": True} if enabled(x) else {}


@triton.jit
def launch_dependents():
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait():
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 128-byte lines at `ptrs` (valid addresses) to be brought into L2; no registers, no wait."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
