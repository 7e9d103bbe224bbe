"""SwiGLU's activation over the merged gate/up projection (notebook 03): the torch definition, or the engine's
kernel for it (minivllm/kernels: Triton on a GPU, C++ on CPU)."""

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.utils.compile import compiled
from minivllm.utils.context import get_context


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul: last dim {x.shape[-1]} is odd; expected gate and up halves")
        ops = get_context().ops
        return ops.silu_and_mul(x) if ops.silu_and_mul else self.silu_and_mul(x)

    @compiled
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # (N, 2I) -> 2 x (N, I): front half gate, back half up
        return F.silu(gate) * up  # (N, I)
