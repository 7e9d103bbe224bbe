"""SwiGLU's activation over the merged gate/up projection (notebook 03)."""

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.utils.compile import compiled


class SiluAndMul(nn.Module):
    @compiled
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # (N, 2I) -> 2 x (N, I): front half gate, back half up
        return F.silu(gate) * up  # (N, I)
