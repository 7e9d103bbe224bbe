"""Rotary position embedding, neox half-split style, one cos/sin cache shared by all layers (notebook 02): the
torch definition, or the engine's kernel for it, bound at construction (minivllm/kernels)."""

from functools import lru_cache

import torch
from torch import nn

from minivllm.kernels.table import TORCH, Ops


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x.float(), 2, dim=-1)  # pair dim i with dim i + d/2
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    return torch.cat((y1, y2), dim=-1).to(x.dtype)


def rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor):
    # positions: (N,), query: (N, num_heads, head_dim), key: (N, num_kv_heads, head_dim)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # 2 x (N, 1, head_dim / 2)
    return apply_rotary_emb(query, cos, sin), apply_rotary_emb(key, cos, sin)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float, *, ops: Ops = TORCH
    ) -> None:
        super().__init__()
        if rotary_dim != head_size:
            raise ValueError(
                f"RotaryEmbedding: partial rotary (rotary_dim={rotary_dim} != head_size={head_size}) is not supported"
            )
        self.head_size = head_size
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float)
        freqs = torch.einsum("i,j->ij", t, inv_freq)  # (max_pos, rotary_dim / 2)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # (max_pos, rotary_dim)
        self.register_buffer("cos_sin_cache", cache.unsqueeze_(1), persistent=False)  # (max_pos, 1, rotary_dim)
        self._rotary = ops.bind(ops.rotary, rotary, token_args=3)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        return self._rotary(positions, query, key, self.cos_sin_cache)  # (N, heads, D), (N, kv_heads, D)


def rope_theta_of(config) -> float:
    """rope_theta from transformers 5 (`config.rope_parameters`) or older configs (top-level)."""
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta (neither in rope_parameters nor at top level)")
    return float(theta)


def rope_scaling_of(config) -> dict | None:
    """The scaling dict, or None for plain RoPE. Only the default (no scaling) is implemented."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    return None if kind == "default" else params


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: tuple | None = None,
    *,
    ops: Ops = TORCH,
) -> RotaryEmbedding:
    """One RotaryEmbedding (one cos/sin table) shared by every layer of a model. Cached per device and kernel
    table too, so a model built on another device or with other kernels does not get (or move) this one's."""
    if rope_scaling is not None:
        raise NotImplementedError(f"rope scaling {dict(rope_scaling)} is not implemented (only plain RoPE)")
    return _shared_rope(head_size, rotary_dim, max_position, base, torch.get_default_device(), ops)


@lru_cache(1)  # `device` only keys the cache: the table is built on the default device, which get_rope read
def _shared_rope(
    head_size: int, rotary_dim: int, max_position: int, base: float, device: torch.device, ops: Ops
) -> RotaryEmbedding:
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, ops=ops)


get_rope.cache_clear = _shared_rope.cache_clear
