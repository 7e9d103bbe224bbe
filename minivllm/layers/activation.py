"""SwiGLU's activation over the merged gate/up projection (notebook 03): the torch definition (the reference, and
CPU without the C++ library), a Triton kernel (CUDA: utils/compile.py says why not torch.compile) and its C++ twin
for CPU (layers/cpu_ops.py)."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from minivllm.layers import cpu_ops
from minivllm.utils.compile import compiled, runs_triton


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # grid (rows, column blocks of the I outputs)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * 2 * I + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * I + I + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu: in fp32, rounded to the input's dtype
    tl.store(out_ptr + row * I + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """(..., 2I) -> (..., I): silu(front half) * back half, one kernel."""
    I = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * I).contiguous()  # (N, 2I)
    out = torch.empty(rows.shape[0], I, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(I))
    if rows.shape[0]:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(I, block))](rows, out, I, BLOCK=block)
    return out.view(*x.shape[:-1], I)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul: last dim {x.shape[-1]} is odd; expected gate and up halves")
        if runs_triton(x):
            return silu_and_mul_triton(x)
        return cpu_ops.silu_and_mul(x) if cpu_ops.runs_on(x) else self.silu_and_mul(x)

    @compiled
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # (N, 2I) -> 2 x (N, I): front half gate, back half up
        return F.silu(gate) * up  # (N, I)
