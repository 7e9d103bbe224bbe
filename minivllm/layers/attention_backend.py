"""Which attention kernels run: one decision point (`select`), and the backend as an object (`create`).

- "flash_attn": the flash-attn package (FA2), nano-vllm's two calls (layers/flash_attention.py);
- "fa4": FlashAttention-4 (`flash_attn.cute`), on SM90 and later (layers/flash_attention.py);
- "torch": plain torch over the same paged cache, on any device, CPU users and CI (layers/torch_attention.py).
An engine asks `select(device, dtype, Config.attention_backend)` once: a name forces that backend, None picks the
fastest available. The runner builds that backend's object and the model gives it to each Attention layer at
construction, so two engines in one process can use different backends.

A backend object has the three calls the layer makes (`prefill`, `prefill_paged`, `decode`) and the metadata they
read, made once per step (layers/attention_metadata.py). Decode with the flash backends runs our Triton kernel
instead of theirs (kernels/triton/paged_decode.py: GQA-grouped, split-KV for small batches) unless the
`decode_kernel` kernel option asks for the backend's own; on CPU the C++ one when built: the engine's kernel table
holds it and the runner passes it as `decode`."""

from collections.abc import Callable

import torch

from minivllm.layers import torch_attention
from minivllm.layers.attention_metadata import AttentionBackend
from minivllm.layers.flash_attention import FA4_MIN_SEQLEN_Q, FA4Backend, FlashAttnBackend, _fa2, _fa4, fa4_cache_env

BACKENDS = ("flash_attn", "fa4", "torch")
__all__ = ["BACKENDS", "FA4_MIN_SEQLEN_Q", "TorchBackend", "available", "create", "fa4_cache_env", "select"]


class TorchBackend(AttentionBackend):
    """Plain torch over the paged cache: -1 padded block tables, checked (layers/torch_attention.py)."""

    name = "torch"

    def __init__(self, decode: Callable | None = None) -> None:
        super().__init__(decode)
        self.gathers: dict = {}  # the last decode gather, shared by the engine's layers (torch_attention.decode_gather)

    def prefill(self, q, k, v, cu_seqlens, max_seqlen: int, scale: float) -> torch.Tensor:
        """Fresh K/V, packed by cu_seqlens: q (N, H, D), k/v (N, Hkv, D) -> (N, H, D)."""
        return torch_attention.varlen_attention(q, k, v, cu_seqlens, scale)

    def prefill_paged(self, q, k_cache, v_cache, *, cu_seqlens_q, context_lens, block_tables, scale, **_):
        """Queries are the new tokens, keys come from the cache through block_tables (S, M) int32 (a prefix hit, a
        later chunk) -> (N, H, D). The flash backends also take cu_seqlens_k, max_seqlen_q and max_seqlen_k."""
        return torch_attention.paged_prefill_attention(
            q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale
        )

    def own_decode(self, q, k_cache, v_cache, context_lens, block_tables, scale: float) -> torch.Tensor:
        """One query per sequence: q (B, H, D) -> (B, H, D)."""
        return torch_attention.paged_decode_attention(
            q, k_cache, v_cache, context_lens, block_tables, scale, self.gathers
        )


CLASSES = {"torch": TorchBackend, "flash_attn": FlashAttnBackend, "fa4": FA4Backend}


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


def create(name: str = "torch", decode: Callable | None = None) -> AttentionBackend:
    """The backend `name`'s object (`select` says which can run here); `decode` replaces its own decode."""
    if name not in CLASSES:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    return CLASSES[name](decode)
