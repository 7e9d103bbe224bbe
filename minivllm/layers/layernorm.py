"""RMSNorm, plain and with the residual add fused in (notebook 01): the torch definition, which is the reference
and what runs without a kernel, or the engine's kernel for it, bound at construction (minivllm/kernels: Triton on
a GPU, C++ on CPU)."""

import torch
from torch import nn

from minivllm.kernels.table import TORCH, Ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim: the variance in fp32, then cast to out_dtype
    (default x's dtype) before the weight multiplies, as transformers does."""
    out_dtype = out_dtype or x.dtype
    x = x.float()
    var = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(var + eps)
    return x.to(out_dtype) * weight


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the add in fp32, the new residual is the sum."""
    s = x.float() + residual.float()
    return rms_norm(s, weight, eps, x.dtype), s.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, *, ops: Ops = TORCH) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self._rms_norm = ops.bind(ops.rms_norm, rms_norm)
        self._add_rms_norm = ops.bind(ops.add_rms_norm, add_rms_norm, token_args=2)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"RMSNorm: last dim of input is {x.shape[-1]}, expected {self.weight.shape[0]}")
        if residual is None:
            return self._rms_norm(x, self.weight, self.eps)
        if residual.shape != x.shape:
            raise ValueError(f"RMSNorm: residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
        return self._add_rms_norm(x, residual, self.weight, self.eps)
