"""The attention layer (seed 000 section 7, seed 002 section 5): write the new K/V into the paged cache,
then one of three paths: prefill over fresh K/V, prefill over the paged cache (a cached prefix or a later
chunk: q shorter than k), or decode (one query per sequence)."""
import torch
from torch import nn

from minivllm.layers import attention_backend
from minivllm.layers.store_kvcache import store_kvcache
from minivllm.layers.torch_attention import store_kvcache_torch
from minivllm.utils.context import get_context


class Attention(nn.Module):

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])   # (num_blocks, block_size, kv_heads, head_dim), set by the runner
        self.backend: str | None = None                  # chosen on first call, see attention_backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stored: bool = False) -> torch.Tensor:
        # q: (N, num_heads, head_dim), k/v: (N, num_kv_heads, head_dim) -> (N, num_heads, head_dim)
        # stored: k/v are already in the cache (the fused attention_prologue kernel wrote them)
        context = get_context()
        k_cache, v_cache = self.k_cache, self.v_cache
        backend = self.backend or attention_backend.select(q.device, q.dtype)
        if k_cache.numel() and v_cache.numel() and not stored:   # Triton on GPU; index assignment on CPU
            store = store_kvcache if k_cache.is_cuda else store_kvcache_torch
            store(k, v, k_cache, v_cache, context.slot_mapping)
        if context.is_prefill:
            if context.block_tables is not None:           # keys come from the cache: q is shorter than k
                return attention_backend.prefill_paged(
                    backend, q, k_cache, v_cache, context.cu_seqlens_q, context.cu_seqlens_k, context.max_seqlen_q,
                    context.max_seqlen_k, context.context_lens, self.tables(backend, context), self.scale)
            return attention_backend.prefill(backend, q, k, v, context.cu_seqlens_q, context.max_seqlen_q, self.scale)
        return attention_backend.decode(backend, q, k_cache, v_cache, context.context_lens, self.tables(backend, context),
                                        self.scale)

    @staticmethod
    def tables(backend: str, context) -> torch.Tensor:
        """The flash kernels read every table entry: they get the -1 padding mapped to block 0, made once per
        step (not once per layer); the torch path checks the -1 padded tables itself."""
        return context.block_tables if backend == "torch" else context.page_table()
