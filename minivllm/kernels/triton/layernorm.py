"""RMSNorm, plain and with the residual add fused in, as one Triton kernel for both forms (notebook 01; the torch
definition it computes is layers/layernorm.py's `rms_norm`): one program per row, compiled once for any token count."""

import torch
import triton
import triton.language as tl


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_triton(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_triton(x, weight, eps, residual)
