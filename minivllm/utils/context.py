"""The step context: metadata of the current forward pass, set once per step by the model runner and read
by the attention layers and the LM head, so it need not be threaded through every forward call (nano-vllm's
utils/context.py). It also carries the engine's kernel table (minivllm/kernels), so two engines in one process
each run their own. One context per thread: an engine loop in a server thread and another engine in the main
thread do not see each other's steps."""

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from minivllm.kernels import TORCH, Ops


@dataclass(slots=True)
class Context:
    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None  # (num_seqs + 1,) int32, prefill: query offsets
    cu_seqlens_k: torch.Tensor | None = None  # (num_seqs + 1,) int32, prefill: key offsets
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None  # (num_tokens,) int32, cache slot per new token, -1 = skip
    context_lens: torch.Tensor | None = None  # (num_seqs,) int32, tokens in cache after this step
    block_tables: torch.Tensor | None = None  # (num_seqs, max_blocks) int32, -1 padded
    num_decode_rows: int = 0  # prefill over the cache: its first rows have one query each (attended as decode)
    ops: Ops = TORCH  # the engine's kernels; outside a step the torch definitions
    attention_backend: str | None = None  # overrides the layers' backend for this step (the warm-up's prefill)
    _page_table: torch.Tensor | None = None
    _prefill_rows: "PrefillRows | None" = None

    def page_table(self) -> torch.Tensor | None:
        """block_tables with the -1 padding mapped to block 0 (for kernels that read every entry), made on
        first use and shared by every layer of the step."""
        if self._page_table is None and self.block_tables is not None:
            self._page_table = self.block_tables.clamp(min=0)
        return self._page_table

    def prefill_rows(self, tables: torch.Tensor) -> "PrefillRows":
        """The rows after the first num_decode_rows, the ones the prefill kernel takes. `tables`: the step's
        block tables as the backend reads them (block_tables or page_table()). With decode rows first, in fresh
        tensors (kernels get aligned copies, not views at an odd offset), made once and shared by every layer."""
        d = self.num_decode_rows
        if d == 0:
            return PrefillRows(self.cu_seqlens_q, self.cu_seqlens_k, self.context_lens, tables)
        if self._prefill_rows is None:
            self._prefill_rows = PrefillRows(
                cu_seqlens_q=self.cu_seqlens_q[d:] - d,
                cu_seqlens_k=self.cu_seqlens_k[d:] - self.cu_seqlens_k[d],
                context_lens=self.context_lens[d:].clone(),
                block_tables=tables[d:].clone(),
            )
        return self._prefill_rows


@dataclass(slots=True)
class PrefillRows:
    """A prefill step's rows after its decode rows: offsets from 0 again."""

    cu_seqlens_q: torch.Tensor  # (rows + 1,) int32
    cu_seqlens_k: torch.Tensor  # (rows + 1,) int32
    context_lens: torch.Tensor  # (rows,) int32
    block_tables: torch.Tensor  # (rows, max_blocks) int32


_local = threading.local()


def get_context() -> Context:
    context = getattr(_local, "context", None)
    if context is None:
        context = _local.context = Context()
    return context


def set_context(
    is_prefill: bool,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
    slot_mapping: torch.Tensor | None = None,
    context_lens: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    num_decode_rows: int = 0,
    ops: Ops = TORCH,
    attention_backend: str | None = None,
) -> None:
    _local.context = Context(
        is_prefill=is_prefill,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        slot_mapping=slot_mapping,
        context_lens=context_lens,
        block_tables=block_tables,
        num_decode_rows=num_decode_rows,
        ops=ops,
        attention_backend=attention_backend,
    )


def reset_context() -> None:
    _local.context = Context()


@contextmanager
def use_ops(ops: Ops):
    """`with use_ops(ops): layer(x)`: layers called in the block, outside an engine's step, run `ops`."""
    old = get_context()
    _local.context = Context(ops=ops)
    try:
        yield ops
    finally:
        _local.context = old
