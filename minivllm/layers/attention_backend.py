"""Which attention kernels run: one decision point, overridable for tests (nanochat's habit).

- "flash_attn": the flash-attn package (FA2), nano-vllm's two calls;
- "fa4": FlashAttention-4 (`flash_attn.cute`), on SM90+ (the H200);
- "torch": plain torch over the same paged cache, on any device (CPU users and CI).
An engine asks `select(device, dtype, Config.attention_backend)` once: a name forces that backend, None
picks the fastest available. The runner hands the answer to each Attention layer, so two engines in one
process can use different backends.

Decode with the flash backends runs our Triton kernel instead of theirs (kernels/triton/paged_decode.py:
GQA-grouped, split-KV for small batches; the engine's kernel table holds it) unless the `decode_kernel` kernel
option asks for the backend's own; on CPU the C++ one when built."""

import os
import warnings
from functools import lru_cache

import torch

from minivllm.layers import torch_attention
from minivllm.utils.default_model import cache_root

BACKENDS = ("flash_attn", "fa4", "torch")

# FlashAttention-4 compiles a separate kernel when every sequence's queries fit in one tile of rows (up to 256
# on any GPU it supports, GQA heads packed in): its `max_seqlen_q` is an upper bound used for the grid, so
# prefill passes at least this many and short prefills run the same kernel as long ones (model_runner.py).
FA4_MIN_SEQLEN_Q = 257


@lru_cache(None)
def _fa2():
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        return flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError:
        return None


def fa4_cache_env() -> None:
    """FlashAttention-4 compiles each kernel variant on first use (4-6 s on a bare machine); its own on-disk
    cache keeps them for the next process. Off by default upstream: on here unless the user set it. Read when
    it is imported, so set before (engine/startup's helper process inherits it)."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", os.path.join(cache_root(), "flash_attention_cute"))


@lru_cache(None)
def _fa4():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return None
    fa4_cache_env()
    try:
        from flash_attn.cute import flash_attn_varlen_func

        return flash_attn_varlen_func
    except Exception as e:  # not installed, or installed without its CUTLASS libraries (a RuntimeError)
        if not isinstance(e, ImportError):
            warnings.warn(
                f"FlashAttention-4 is installed but does not import ({type(e).__name__}: {e}); "
                "using the other attention backends",
                stacklevel=2,
            )
        return None


def available(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Backends that can run on `device` for `dtype`, fastest first (the flash kernels take fp16/bf16 only)."""
    if torch.device(device).type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return ["torch"]
    return [name for name, ok in (("fa4", _fa4()), ("flash_attn", _fa2())) if ok] + ["torch"]


def select(device: torch.device | str, dtype: torch.dtype = torch.bfloat16, name: str | None = None) -> str:
    """The backend to use: `name` if given (an error if it cannot run here), else the fastest available."""
    if name is None:
        return available(device, dtype)[0]
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    if name not in available(device, dtype):
        raise RuntimeError(f"attention backend {name!r} is not available on {device} for {dtype}")
    return name


# --- the three calls the Attention layer makes -------------------------------------------------------


def prefill(backend: str, q, k, v, cu_seqlens, max_seqlen: int, scale: float) -> torch.Tensor:
    """Fresh K/V, packed by cu_seqlens: q (N, H, D), k/v (N, Hkv, D) -> (N, H, D)."""
    if backend == "fa4":
        return _fa4()(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            softmax_scale=scale,
            causal=True,
        )[0]
    if backend == "flash_attn":
        return _fa2()[0](
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            softmax_scale=scale,
            causal=True,
        )
    return torch_attention.varlen_attention(q, k, v, cu_seqlens, scale)


def prefill_paged(
    backend: str,
    q,
    k_cache,
    v_cache,
    *,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    context_lens,
    block_tables,
    scale: float,
) -> torch.Tensor:
    """Queries are the new tokens, keys come from the cache through block tables (prefix hit / chunk).
    block_tables (S, M) int32: the torch backend takes -1 padding; the flash kernels read every entry and
    need valid block ids there (the layer passes `Context.page_table()`, padding mapped to block 0)."""
    if backend == "fa4":
        return _fa4()(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max(max_seqlen_q, FA4_MIN_SEQLEN_Q),  # a bound: more is only a hint, see below
            seqused_k=context_lens,
            page_table=block_tables,
            softmax_scale=scale,
            causal=True,
        )[0]
    if backend == "flash_attn":
        return _fa2()[0](
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=block_tables,
        )
    return torch_attention.paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)


def decode(backend: str, q, k_cache, v_cache, context_lens, block_tables, scale: float) -> torch.Tensor:
    """The backend's own decode, one query per sequence: q (B, H, D) -> (B, H, D). block_tables as in
    prefill_paged."""
    if backend == "fa4":
        return _fa4()(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            seqused_k=context_lens,
            page_table=block_tables,
            softmax_scale=scale,
            causal=True,
        )[0].squeeze(1)
    if backend == "flash_attn":
        return _fa2()[1](
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=context_lens,
            block_table=block_tables,
            softmax_scale=scale,
            causal=True,
        ).squeeze(1)
    return torch_attention.paged_decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale)
