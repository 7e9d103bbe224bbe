"""What an attention backend is: the one call an Attention layer makes (`attend`: which of its three paths a step
takes, `prefill`, `prefill_paged` or `decode`) and its decode kernel, chosen when it is built. The torch backend
(plain torch over the paged cache, kernels/torch_attention.py) is here; the flash backends are flash_attention.py."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.kernels.torch_attention import paged_decode_attention, paged_prefill_attention, varlen_attention
from minivllm.utils.context import Context


@dataclass(slots=True)
class PrefillRows:
    """A prefill step's rows after its decode rows: offsets from 0 again."""

    cu_seqlens_q: torch.Tensor  # (rows + 1,) int32
    cu_seqlens_k: torch.Tensor  # (rows + 1,) int32
    context_lens: torch.Tensor  # (rows,) int32
    block_tables: torch.Tensor  # (rows, max_blocks) int32


class AttentionBackend:
    """The three calls an Attention layer makes (`prefill`, `prefill_paged`, `decode`), in a subclass. `decode`: a
    kernel that replaces the backend's own decode (same signature: ours in Triton, or C++ on CPU)."""

    name = "base"
    keys_from_cache = False  # every prefill reads its keys from the cache (FlashAttention-4: one kernel variant)

    def __init__(self, decode: Callable | None = None) -> None:
        self.decode = decode or self.own_decode

    def own_decode(self, q, k_cache, v_cache, context_lens, block_tables, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def tables(self, context: Context) -> torch.Tensor | None:
        """The step's block tables as the kernels read them: -1 padded (the flash backends map it to block 0)."""
        return context.block_tables

    def prefill_rows(self, context: Context) -> PrefillRows:
        """The rows after the first num_decode_rows, the ones the prefill kernel takes."""
        d, tables = context.num_decode_rows, self.tables(context)
        if d == 0:
            return PrefillRows(context.cu_seqlens_q, context.cu_seqlens_k, context.context_lens, tables)
        cu_q, cu_k = context.cu_seqlens_q[d:] - d, context.cu_seqlens_k[d:] - context.cu_seqlens_k[d]
        return PrefillRows(cu_q, cu_k, context.context_lens[d:], tables[d:])

    def attend(self, q, k, v, k_cache, v_cache, context: Context, scale: float) -> torch.Tensor:
        """The step's attention, its new K/V already in the cache: prefill over fresh K/V, prefill over the cache
        (a cached prefix or a later chunk: q shorter than k), or decode (one query per sequence) -> (N, H, D)."""
        if context.is_prefill:
            if context.block_tables is not None:  # keys come from the cache: q is shorter than k
                return self.attend_paged(q, k_cache, v_cache, context, scale)
            return self.prefill(q, k, v, context.cu_seqlens_q, context.max_seqlen_q, scale)
        return self.decode(q, k_cache, v_cache, context.context_lens, self.tables(context), scale)

    def attend_paged(self, q, k_cache, v_cache, context: Context, scale: float) -> torch.Tensor:
        """A prefill over the cache -> (N, H, D). Its first `num_decode_rows` rows (sequences that decode while
        others prefill: one query each) run the decode kernel, the rest the prefill kernel."""
        d = context.num_decode_rows
        if d:
            tables = self.tables(context)
            decoded = self.decode(q[:d], k_cache, v_cache, context.context_lens[:d], tables[:d], scale)
            if d == q.shape[0]:  # every row has one query
                return decoded
        rows = self.prefill_rows(context)
        out = self.prefill_paged(
            q[d:],
            k_cache,
            v_cache,
            cu_seqlens_q=rows.cu_seqlens_q,
            cu_seqlens_k=rows.cu_seqlens_k,
            max_seqlen_q=context.max_seqlen_q,  # the step's longest: a bound for any of its rows
            max_seqlen_k=context.max_seqlen_k,
            context_lens=rows.context_lens,
            block_tables=rows.block_tables,
            scale=scale,
        )
        return torch.cat([decoded, out]) if d else out  # (d + rest, H, D)


class TorchBackend(AttentionBackend):
    """Plain torch over the paged cache: -1 padded block tables, checked (kernels/torch_attention.py)."""

    name = "torch"

    def __init__(self, decode: Callable | None = None) -> None:
        super().__init__(decode)
        self.gathers: dict = {}  # the last decode gather, shared by the engine's layers (decode_gather)

    def prefill(self, q, k, v, cu_seqlens, max_seqlen: int, scale: float) -> torch.Tensor:
        """Fresh K/V, packed by cu_seqlens: q (N, H, D), k/v (N, Hkv, D) -> (N, H, D)."""
        return varlen_attention(q, k, v, cu_seqlens, scale)

    def prefill_paged(self, q, k_cache, v_cache, *, cu_seqlens_q, context_lens, block_tables, scale, **_):
        """New queries, keys from the cache through block_tables (S, M) int32 -> (N, H, D)."""
        return paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)

    def own_decode(self, q, k_cache, v_cache, context_lens, block_tables, scale: float) -> torch.Tensor:
        """One query per sequence: q (B, H, D) -> (B, H, D)."""
        return paged_decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale, self.gathers)
