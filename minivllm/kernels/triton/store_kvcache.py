"""store_kvcache: scatter each new token's K and V into its slot of the paged cache, one Triton program per token,
slot -1 skipped (notebook 06). Runs on CUDA, and on CPU through the Triton interpreter, which copies the whole cache
at each launch: a CPU engine stores with its C++ operator or `store_kvcache_torch` (layers/attention.py)."""

import torch
import triton
import triton.language as tl


@triton.jit
def store_kvcache_kernel(
    key_ptr,
    key_stride,
    value_ptr,
    value_stride,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    idx = tl.program_id(0)  # one program per token
    slot = tl.load(slot_mapping_ptr + idx).to(tl.int64)
    if slot == -1:  # padding (CUDA-graph batch): write nothing
        return
    offs = tl.arange(0, BLOCK_D)  # BLOCK_D = next power of 2 >= D (tl.arange needs it)
    mask = offs < D
    key = tl.load(key_ptr + idx * key_stride + offs, mask=mask)
    value = tl.load(value_ptr + idx * value_stride + offs, mask=mask)
    cache_offsets = slot * D + offs
    tl.store(k_cache_ptr + cache_offsets, key, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value, mask=mask)


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key, value: (N, num_kv_heads, head_dim), rows may be strided slices of a fused qkv tensor;
    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim); slot_mapping: (N,) int32/int64."""
    N, num_heads, head_dim = key.shape
    D = num_heads * head_dim
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be contiguous"
    assert key.stride(1) == head_dim and value.stride(1) == head_dim, "heads of a token must be contiguous"
    assert k_cache.stride(1) == D and v_cache.stride(1) == D, "each cache slot must hold D contiguous values"
    assert value.shape == key.shape, f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}"
    assert k_cache.shape[2:] == key.shape[1:], (
        f"cache (kv_heads, head_dim) {tuple(k_cache.shape[2:])} != key's {tuple(key.shape[1:])}"
    )
    assert slot_mapping.numel() == N, f"slot_mapping has {slot_mapping.numel()} entries for {N} tokens"
    if N == 0:
        return
    store_kvcache_kernel[(N,)](
        key,
        key.stride(0),
        value,
        value.stride(0),
        k_cache,
        v_cache,
        slot_mapping,
        D=D,
        BLOCK_D=triton.next_power_of_2(D),
    )
