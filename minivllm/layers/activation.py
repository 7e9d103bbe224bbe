"""SwiGLU's activation over the merged gate/up projection (notebook 03): the torch definition, or the engine's
kernel for it, bound at construction (minivllm/kernels: Triton on a GPU, C++ on CPU)."""

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.kernels.table import TORCH, Ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # (N, 2I) -> 2 x (N, I): front half gate, back half up
    return F.silu(gate) * up  # (N, I)


class SiluAndMul(nn.Module):
    def __init__(self, *, ops: Ops = TORCH) -> None:
        super().__init__()
        self._silu_and_mul = ops.bind(ops.silu_and_mul, silu_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul: last dim {x.shape[-1]} is odd; expected gate and up halves")
        return self._silu_and_mul(x)
