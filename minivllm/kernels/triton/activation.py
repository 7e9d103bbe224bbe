"""SwiGLU's activation over the merged gate/up projection as one Triton kernel (notebook 03; the torch definition
is layers/activation.py's `SiluAndMul.silu_and_mul`)."""

import torch
import triton
import triton.language as tl


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


silu_and_mul = silu_and_mul_triton
