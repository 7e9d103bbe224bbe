"""Linear layers on CPU through oneDNN with each weight packed once, after loading, into the blocked layout its
matmul kernels read (what torch's inductor does for CPU inference when it freezes a model). A plain `F.linear`
hands oneDNN the row-major weight, which it re-lays out for every call; at decode batch sizes that is most of
the call. Measured on a 2-core machine: the SmolLM2 matmuls 1.5-3x faster at 16 tokens, the LM head 3x in fp32.

The packed weight is a copy (an opaque oneDNN tensor): the `nn.Parameter` stays what the loader wrote, for the
embedding it may be tied to, for tests and for TP's sharding. A CPU engine's kernel table holds `pack` and `linear`
(`Ops.pack_linear`, `Ops.linear`; not with the `cpu_packed_linear` kernel option off): each linear layer binds them
when it is built, the runner has each layer pack its weight after the load (`pack_weight`), and `linear(x, weight,
bias, packed)` uses the packed copy when there is one. GPUs never see any of it."""

import torch
import torch.nn.functional as F


def packable(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (weight.dtype != torch.bfloat16 or bf16_supported())
    )


def bf16_supported() -> bool:
    """oneDNN packs and runs bf16 weights only on CPUs with bf16 instructions (AVX-512 BF16, AMX or
    AVX-NE-CONVERT); elsewhere bf16 layers keep F.linear."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The (out, in) weight in oneDNN's layout for any number of input rows, or None where that cannot run."""
    if not packable(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)  # None: any batch size


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias), through the packed weight when there is one: x (..., in) -> (..., out)."""
    if packed is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
