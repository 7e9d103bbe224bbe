"""L2 prefetch of the next weights during a decode graph (GPU, Hopper and later; benchmarks/NOTES.md part IX).

A decode step of a small model runs ~112 matmuls of a few MB of weights each, and each takes 5-8 us where its
bytes alone would take 1-3 us at the memory bandwidth: most of a small matmul is its start and tail, the first
loads waiting on DRAM while most SMs idle. A layer's weights (30 MB for Qwen3-0.6B) fit in the H200's 50 MB
L2 cache. So while one matmul runs, a one-program kernel on a second stream asks the copy engine of its SM
(TMA) to bring the *next* matmul's weight from DRAM into L2 (`cp.async.bulk.prefetch.L2`: fire and forget,
nothing is loaded into registers), and that matmul then reads L2 instead of DRAM.

Nothing reads what a prefetch does, so it cannot change a result: a prefetch that lands late or is evicted
only costs the time it would have saved. `StepPrefetch` installs it: during the capture of a decode graph each
linear layer's forward first forks the prefetch of the following linear layer's weight onto the side stream,
and the step joins the side stream at its end (a graph must end on the stream it began on)."""

from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from torch import nn

# one lane issues one bulk prefetch of CHUNK bytes; a program has LANES lanes (one warp)
CHUNK = 64 * 1024
LANES = 32
# PTX: a bulk prefetch into L2, marked evict-last so the KV cache streaming past does not push it out first
PREFETCH_EVICT_LAST = tl.constexpr(
    "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
    "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }"
)
PREFETCH = tl.constexpr("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;")


@triton.jit
def l2_prefetch_kernel(base_ptr, n_bytes, CHUNK: tl.constexpr, LANES: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Lane i of program p prefetches bytes [c * CHUNK, (c + 1) * CHUNK) of the tensor, c = p * LANES + i."""
    c = tl.program_id(0) * LANES + tl.arange(0, LANES)
    off = c.to(tl.int64) * CHUNK
    size = tl.minimum(n_bytes - off, CHUNK)
    live = size > 0
    # every lane runs the instruction: a lane past the end prefetches the first 16 bytes again
    addr = tl.where(live, (base_ptr + off).to(tl.int64), base_ptr.to(tl.int64))
    size = tl.where(live, size, 16).to(tl.int32)
    if EVICT_LAST:
        tl.inline_asm_elementwise(PREFETCH_EVICT_LAST, "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(PREFETCH, "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(t: torch.Tensor, *, chunk: int | None = None, lanes: int = LANES, evict_last: bool = True) -> None:
    """Ask for contiguous CUDA tensor `t`'s bytes to be brought into L2 (on the current stream; returns at once)."""
    chunk = chunk or CHUNK
    if not (t.is_cuda and t.is_contiguous()):
        raise ValueError(f"l2 prefetch: needs a contiguous CUDA tensor, got device {t.device}, shape {tuple(t.shape)}")
    n_bytes = t.numel() * t.element_size()
    if n_bytes % 16 or t.data_ptr() % 16:
        raise ValueError(f"l2 prefetch: {n_bytes} bytes at {t.data_ptr():#x}: size and address must be multiples of 16")
    flat = t.view(-1).view(torch.uint8)
    grid = (triton.cdiv(triton.cdiv(n_bytes, chunk), lanes),)
    l2_prefetch_kernel[grid](flat, n_bytes, CHUNK=chunk, LANES=lanes, EVICT_LAST=evict_last, num_warps=1)


def supported(device: torch.device) -> bool:
    """Bulk prefetch (TMA) exists from Hopper (SM 9.0) on."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


class StepPrefetch:
    """For a model's decode step: linear layer i prefetches the weight of linear layer i + 1 (their order of
    registration, which is the order a Qwen3/Llama step runs them: qkv, o, gate/up, down, next layer's qkv)."""

    def __init__(self, model: nn.Module, linear_type: type, *, ahead: int = 1) -> None:
        linears = [m for m in model.modules() if isinstance(m, linear_type)]
        self.pairs = [(a, b.weight) for a, b in zip(linears, linears[ahead:])]  # (layer, weight it prefetches)
        self.side: torch.cuda.Stream | None = None

    def _hook(self, weight: torch.Tensor):
        def pre_forward(module, args):
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)  # fork: the prefetch starts when this layer does
            with torch.cuda.stream(self.side):
                prefetch(weight)

        return pre_forward

    @contextmanager
    def around(self, device: torch.device):
        """Prefetch during the block (a decode step being captured or run eagerly), then join the side stream."""
        self.side = self.side or torch.cuda.Stream(device)
        handles = [layer.register_forward_pre_hook(self._hook(w)) for layer, w in self.pairs]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            torch.cuda.current_stream().wait_stream(self.side)  # join
