"""RMSNorm, plain and with the residual add fused in (seed 000 section 2). On a GPU decode batch it runs as
our Triton kernel (one program per row) so that it joins the chain of PDL kernels (utils/pdl.py); elsewhere
through torch.compile."""
import torch
import triton
import triton.language as tl
from torch import nn

from minivllm.layers import skinny_gemm
from minivllm.utils import pdl
from minivllm.utils.compile import compiled


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim: the variance in fp32, then cast to out_dtype
    (default x's dtype) before the weight multiplies, as transformers does."""
    out_dtype = out_dtype or x.dtype
    x = x.float()
    var = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(var + eps)
    return x.to(out_dtype) * weight


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, eps, BLOCK: tl.constexpr,
                    HAS_RES: tl.constexpr, PDL: tl.constexpr):
    """One row (contiguous, H long): [s = x + res, written to res_out;] out = rms_norm(s) * w, the same
    roundings as `rms_norm` (fp32 sum and variance, normalised value cast to x's dtype, then times w)."""
    if PDL == 1:
        pdl.launch_dependents()
    if PDL:
        pdl.wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * H + cols, x.to(res_out_ptr.dtype.element_ty), mask=ok)
    var = tl.sum(x * x, axis=0) / H
    if PDL == 2:
        pdl.launch_dependents()
    ty = out_ptr.dtype.element_ty
    x = (x * tl.rsqrt(var + eps)).to(ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (x * w).to(ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x (M, H) contiguous -> rms_norm(x), or with residual -> (rms_norm(x + residual), x + residual)."""
    M, H = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    rms_norm_kernel[(M,)](x, residual if residual is not None else x, weight, out, res_out, H, eps,
                          BLOCK=triton.next_power_of_2(H), HAS_RES=residual is not None, PDL=pdl.mode(x),
                          num_warps=4, **pdl.launch_kwargs(x))
    return out if residual is None else (out, res_out)


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
        x = x.float() + residual.float()                # residual add in fp32
        residual = x.to(orig_dtype)                     # the new residual is the sum
        return rms_norm(x, self.weight, self.eps, orig_dtype), residual

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"RMSNorm: last dim of input is {x.shape[-1]}, expected {self.weight.shape[0]}")
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"RMSNorm: residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
        if self.triton_ok(x, residual):        # GPU decode batch with PDL: one kernel in the chain
            return rms_norm_triton(x, self.weight, self.eps, residual)
        if residual is None:
            return self.rms_forward(x)
        return self.add_rms_forward(x, residual)

    def triton_ok(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (skinny_gemm.decode_batch(x) and pdl.enabled(x) and x.is_contiguous() and self.weight.dtype == x.dtype
                and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype)))
