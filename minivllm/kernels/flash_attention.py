"""The flash attention backends: the flash-attn package (FA2, nano-vllm's two calls) and FlashAttention-4
(`flash_attn.cute`, SM90 and later), each imported on first use. Their kernels read every block-table entry, so
they get the padding mapped to block 0 (`FlashBackend.tables`)."""

import os
import warnings
from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache

import torch

from minivllm.kernels.attention_backend import AttentionBackend, PrefillRows
from minivllm.kernels.cache import cache_root
from minivllm.utils.context import Context

# FlashAttention-4 compiles a separate kernel when every sequence's queries fit in one tile of rows (up to 256
# on any GPU it supports, GQA heads packed in): its `max_seqlen_q` is an upper bound used for the grid, so
# prefill passes at least this many and short prefills run the same kernel as long ones.
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
    it is imported, so set before (kernels/startup's helper process inherits it)."""
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


class FlashBackend(AttentionBackend):
    """What both flash backends share: their kernels read every block-table entry, and a step's metadata is made once
    per step, by its first layer, not once per layer."""

    def __init__(self, decode: Callable | None = None) -> None:
        super().__init__(decode)
        self._memo: dict = {}  # one step's metadata: {"context": the step's context, name: value}

    def per_step(self, context: Context, name: str, make: Callable):
        """`make()` once per step, by its first layer, then reused (the runner sets a fresh context per step and per
        graph capture; inside a capture the value is made in the graph)."""
        if self._memo.get("context") is not context:
            self._memo = {"context": context}
        if name not in self._memo:
            self._memo[name] = make()
        return self._memo[name]

    def prefill_rows(self, context: Context) -> PrefillRows:
        """The prefill rows after the decode rows in fresh tensors (kernels get aligned copies, not views at an odd
        offset), made once per step."""
        sliced = super().prefill_rows
        if context.num_decode_rows == 0:
            return sliced(context)

        def make() -> PrefillRows:
            rows = sliced(context)  # its cu_seqlens are fresh tensors already
            return replace(rows, context_lens=rows.context_lens.clone(), block_tables=rows.block_tables.clone())

        return self.per_step(context, "rows", make)

    def tables(self, context: Context) -> torch.Tensor | None:
        """The step's block tables with the -1 padding mapped to block 0 (never read: past each context), made once
        per step, not once per layer."""
        if context.block_tables is None:
            return None
        return self.per_step(context, "tables", lambda: context.block_tables.clamp(min=0))


class FlashAttnBackend(FlashBackend):
    """flash-attn (FA2): `flash_attn_varlen_func` for both prefills, `flash_attn_with_kvcache` for decode."""

    name = "flash_attn"

    def prefill(self, q, k, v, cu_seqlens, max_seqlen: int, scale: float) -> torch.Tensor:
        """Fresh K/V, packed by cu_seqlens: q (N, H, D), k/v (N, Hkv, D) -> (N, H, D)."""
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

    def prefill_paged(
        self, q, k_cache, v_cache, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_tables, scale, **_
    ) -> torch.Tensor:
        """New queries, keys from the cache through `block_tables` (S, M) int32 -> (N, H, D)."""
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

    def own_decode(self, q, k_cache, v_cache, context_lens, block_tables, scale: float) -> torch.Tensor:
        """One query per sequence: q (B, H, D) -> (B, H, D)."""
        return _fa2()[1](
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=context_lens,
            block_table=block_tables,
            softmax_scale=scale,
            causal=True,
        ).squeeze(1)


class FA4Backend(FlashBackend):
    """FlashAttention-4. It compiles one kernel per variant it meets (~3-4 s each), keys fresh or through the page
    table being one: every prefill reads its keys from the cache (`keys_from_cache`), one variant serving them all,
    compiled at start-up (kernels/startup/)."""

    name = "fa4"
    keys_from_cache = True

    def prefill(self, q, k, v, cu_seqlens, max_seqlen: int, scale: float) -> torch.Tensor:
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

    def prefill_paged(
        self, q, k_cache, v_cache, *, cu_seqlens_q, max_seqlen_q, context_lens, block_tables, scale, **_
    ) -> torch.Tensor:
        return _fa4()(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max(max_seqlen_q, FA4_MIN_SEQLEN_Q),  # a bound: more is only a hint (FA4_MIN_SEQLEN_Q)
            seqused_k=context_lens,
            page_table=block_tables,
            softmax_scale=scale,
            causal=True,
        )[0]

    def own_decode(self, q, k_cache, v_cache, context_lens, block_tables, scale: float) -> torch.Tensor:
        return _fa4()(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            seqused_k=context_lens,
            page_table=block_tables,
            softmax_scale=scale,
            causal=True,
        )[0].squeeze(1)
