"""RMSNorm, plain and with the residual add fused in (notebook 01): the torch definition (the reference, and CPU
without the C++ library), one Triton kernel for both forms (CUDA: utils/compile.py says why not torch.compile) and
their C++ twins for CPU (layers/cpu_ops.py)."""

import torch
import triton
import triton.language as tl
from torch import nn

from minivllm.layers import cpu_ops
from minivllm.utils.compile import compiled, runs_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim: the variance in fp32, then cast to out_dtype
    (default x's dtype) before the weight multiplies, as transformers does."""
    out_dtype = out_dtype or x.dtype
    x = x.float()
    var = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(var + eps)
    return x.to(out_dtype) * weight


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    w_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # one program per row (token) of H values
    offs = tl.arange(0, BLOCK)  # BLOCK = next power of 2 >= H
    mask = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # the add in fp32; the new residual is the sum in the input's dtype
        x += tl.load(residual_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_out_ptr + row * H + offs, x.to(residual_out_ptr.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, axis=0) / H
    y = (x * tl.rsqrt(var + eps)).to(residual_out_ptr.dtype.element_ty)  # cast before the weight, as rms_norm
    w = tl.load(w_ptr + offs, mask=mask)
    tl.store(out_ptr + row * H + offs, (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x) (or of x + residual, returning the sum too) as one kernel: x (..., H) -> (..., H)."""
    H = x.shape[-1]
    rows = x.reshape(-1, H).contiguous()  # (N, H)
    res_rows = residual.reshape(-1, H).contiguous() if residual is not None else rows
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(rows) if residual is not None else rows  # its dtype: the pre-weight cast
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            res_rows,
            weight,
            out,
            res_out,
            eps,
            H=H,
            BLOCK=triton.next_power_of_2(H),
            HAS_RESIDUAL=residual is not None,
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    @compiled
    def rms_forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    @compiled
    def add_rms_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        orig_dtype = x.dtype
        x = x.float() + residual.float()  # residual add in fp32
        residual = x.to(orig_dtype)  # the new residual is the sum
        return rms_norm(x, self.weight, self.eps, orig_dtype), residual

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"RMSNorm: last dim of input is {x.shape[-1]}, expected {self.weight.shape[0]}")
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"RMSNorm: residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
        if runs_triton(x):
            return rms_norm_triton(x, self.weight, self.eps, residual)
        if cpu_ops.runs_on(x) and self.weight.dtype == x.dtype:
            if residual is None:
                return cpu_ops.rms_norm(x, self.weight, self.eps)
            return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self.rms_forward(x)
        return self.add_rms_forward(x, residual)
