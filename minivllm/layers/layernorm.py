"""RMSNorm, plain and with the residual add fused in (notebook 01): the torch definition, which is the reference
and what runs without a kernel, or the engine's kernel for it (minivllm/kernels: Triton on a GPU, C++ on CPU)."""

import torch
from torch import nn

from minivllm.utils.compile import compiled
from minivllm.utils.context import get_context


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim: the variance in fp32, then cast to out_dtype
    (default x's dtype) before the weight multiplies, as transformers does."""
    out_dtype = out_dtype or x.dtype
    x = x.float()
    var = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(var + eps)
    return x.to(out_dtype) * weight


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
        ops = get_context().ops
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps) if ops.rms_norm else self.rms_forward(x)
        if ops.add_rms_norm:
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        return self.add_rms_forward(x, residual)
