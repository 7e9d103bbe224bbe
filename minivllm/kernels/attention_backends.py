"""Which attention kernels run: one decision point (`select`), and the backend as an object (`create`).

- "flash_attn": the flash-attn package (FA2), nano-vllm's two calls (kernels/flash_attention.py);
- "fa4": FlashAttention-4 (`flash_attn.cute`), on SM90 and later (kernels/flash_attention.py);
- "torch": plain torch over the same paged cache, on any device, CPU users and CI (kernels/attention_backend.py,
  kernels/torch_attention.py).
An engine asks `select(device, dtype, Config.attention_backend)` once: a name forces that backend, None picks the
fastest available. The runner builds that backend's object and the model gives it to each Attention layer at
construction, so two engines in one process can use different backends.

A backend object has the three calls the layer makes (`prefill`, `prefill_paged`, `decode`) and the metadata they
read, made once per step (kernels/attention_backend.py). Decode with the flash backends runs our Triton kernel
instead of theirs (kernels/triton/paged_decode.py: GQA-grouped, split-KV for small batches) unless the
`decode_kernel` kernel option asks for the backend's own; on CPU the C++ one when built: the engine's kernel table
holds it and the runner passes it as `decode`."""

from collections.abc import Callable

import torch

from minivllm.kernels.attention_backend import AttentionBackend, TorchBackend
from minivllm.kernels.flash_attention import FA4_MIN_SEQLEN_Q, FA4Backend, FlashAttnBackend, _fa2, _fa4, fa4_cache_env

BACKENDS = ("flash_attn", "fa4", "torch")
__all__ = ["BACKENDS", "FA4_MIN_SEQLEN_Q", "TorchBackend", "available", "create", "fa4_cache_env", "select"]


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
