"""The step context: metadata of the current forward pass, set once per step by the model runner and read
by the attention layers and the LM head, so it need not be threaded through every forward call (nano-vllm's
utils/context.py, plus the decode rows of a mixed prefill). One context per thread: an engine loop in a server
thread and another engine in the main thread do not see each other's steps."""

import threading
from dataclasses import dataclass

import torch


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


_local = threading.local()


def get_context() -> Context:
    context = getattr(_local, "context", None)
    if context is None:
        context = _local.context = Context()
    return context


def set_context(is_prefill: bool, **fields) -> None:
    """This thread's context for the step: `is_prefill` and any of Context's fields by name, the rest at their
    defaults (an unknown name is a TypeError)."""
    _local.context = Context(is_prefill, **fields)


def reset_context() -> None:
    _local.context = Context()
