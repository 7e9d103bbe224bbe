"""The attention layer: write the new K/V into the paged cache, then one of three paths: prefill over fresh
K/V, prefill over the paged cache (a cached prefix or a later chunk: q shorter than k), or decode (one
query per sequence). Notebook 08 builds it; notebook 07 the online softmax the kernels use.

The layer owns the cache write on both of its paths: `forward(q, k, v)` stores k/v itself (nano-vllm's
path), and `forward_fused(qkv, ...)` runs the fused prologue kernel (QK-norm, RoPE and the store in one
launch, GPU), so the model never touches the cache or the step context. The store and the prologue are the
engine's kernels (minivllm/kernels); the attention is one call to the backend object the layer was given at
construction (kernels/attention_backend.py: which of the three paths a step takes, and their kernels)."""

import torch
from torch import nn

from minivllm.kernels.table import TORCH, AttentionBackend, Ops, torch_backend
from minivllm.utils.context import get_context


def store_kvcache_torch(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The store as masked index assignment: what the Triton kernel does, for CPU. (The Triton interpreter
    copies every tensor argument, the whole cache included, on each launch: far too slow for an engine.)
    The mask makes the shape data-dependent, which is why CUDA graphs need the kernel instead."""
    slots = slot_mapping.long()
    if bool((slots < 0).any()):  # -1 = padding, write nothing (a CPU step has none: it never pads)
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        *,
        ops: Ops = TORCH,
        backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])  # (num_blocks, block_size, kv_heads, head_dim), the runner's
        self.backend = backend or torch_backend()  # the engine's (one object shared by its layers)
        self.store = ops.store_kvcache or store_kvcache_torch
        self.prologue = ops.attention_prologue  # QK-norm, RoPE and the store in one kernel, or None (GPU)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (N, num_heads, head_dim), k/v: (N, num_kv_heads, head_dim) -> (N, num_heads, head_dim)
        context = get_context()
        if self.k_cache.numel() and self.v_cache.numel():
            self.store(k, v, self.k_cache, self.v_cache, context.slot_mapping)
        return self.backend.attend(q, k, v, self.k_cache, self.v_cache, context, self.scale)  # (N, H, D)

    def forward_fused(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        q_norm: nn.Module | None,
        k_norm: nn.Module | None,
    ) -> torch.Tensor:
        """From the QKV projection's output (N, (H + 2 Hkv) * D): QK-norm (when given), RoPE and the cache
        write in one kernel (kernels/triton/attention_prologue.py), then attention -> (N, num_heads, head_dim)."""
        context = get_context()
        q, k, v = self.prologue(
            qkv,
            positions,
            cos_sin_cache,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            q_weight=q_norm.weight if q_norm is not None else None,
            k_weight=k_norm.weight if k_norm is not None else None,
            eps=q_norm.eps if q_norm is not None else 0.0,
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            slot_mapping=context.slot_mapping,
        )
        return self.backend.attend(q, k, v, self.k_cache, self.v_cache, context, self.scale)  # (N, H, D)
