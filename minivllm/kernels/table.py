"""The kernel table: `KernelOptions` (the engine's `Config.kernels`), `Ops` (one engine's kernels, each entry a kernel
or None for the layer's torch definition) and `pick`, the one decision of which kernels an engine runs:

- CUDA: our Triton kernels (`kernels/triton/`) for the norms, SiLU-mul, the attention prologue, the KV-cache store,
  paged decode (flash backends) and the sampler's draw (no slower than torch.compile's, and ~2-3 s less start-up);
  RoPE outside the prologue through torch.compile.
- CPU: the C++ operators (`kernels/cpu/`) for the norms, RoPE, SiLU-mul, the store and paged decode where this
  machine built them, else the torch definitions, eager; the linear layers through oneDNN, weights packed at load."""

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import partial

import torch

from minivllm.kernels.attention_backend import AttentionBackend, TorchBackend
from minivllm.kernels.compiled import compiled

DECODE_KERNELS = ("triton", "flash")
ATTENTION_COMPILE = ("auto", "process", "thread", "off")


@dataclass(slots=True)
class KernelOptions:
    decode_kernel: str = "triton"  # decode attention with a flash backend: "triton" (ours) or "flash" (its own)
    pdl: bool = True  # programmatic dependent launch between our Triton kernels (Hopper; triton/paged_decode.py)
    fused_prologue: bool = True  # QK-norm + RoPE + KV-cache write in one Triton kernel (GPU)
    compile: bool | None = None  # small ops: None our kernels, True torch.compile, False eager torch
    cpu_packed_linear: bool = True  # CPU: linear layers through oneDNN with weights packed at load (cpu/linear.py)
    triton_on_cpu: bool = False  # CPU: run the GPU path's Triton kernels interpreted
    cpu_ops: bool = True  # CPU: norms, RoPE, SiLU-mul, KV store, decode attention in C++ when built (cpu/ops.py)
    attention_compile: str = "auto"  # GPU start: where FlashAttention-4 compiles (kernels/startup/attention_compile.py)
    triton_compile: bool = True  # GPU start: our Triton kernels compile side by side on threads (startup/)

    def __post_init__(self) -> None:
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"unknown decode kernel {self.decode_kernel!r}; choose from {DECODE_KERNELS}")
        if self.attention_compile not in ATTENTION_COMPILE:
            raise ValueError(f"unknown attention_compile {self.attention_compile!r}; choose from {ATTENTION_COMPILE}")
        for f in fields(self):
            if f.type is bool and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"kernel option {f.name} must be True or False, got {getattr(self, f.name)!r}")
        if self.compile not in (None, True, False):
            raise ValueError(f"kernel option compile must be None, True or False, got {self.compile!r}")

    @classmethod
    def of(cls, value: "KernelOptions | dict | None") -> "KernelOptions":
        """Options from a KernelOptions, a dict of its fields (unknown names raise) or None (the defaults)."""
        if isinstance(value, cls):
            return value
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value or {}) - names)
        if unknown:
            raise ValueError(f"unknown kernel option(s) {unknown}; the options are {sorted(names)}")
        return cls(**(value or {}))


@dataclass(frozen=True, slots=True)
class Ops:
    """One engine's kernels. Signatures are the torch definitions' (layers/): None = run that definition."""

    name: str = "torch"
    compile: bool = False  # the torch definitions the layers bind go through torch.compile (`bind`)
    rms_norm: Callable | None = None  # (x, weight, eps) -> y
    add_rms_norm: Callable | None = None  # (x, residual, weight, eps) -> (y, x + residual)
    silu_and_mul: Callable | None = None  # (N, 2I) -> (N, I)
    rotary: Callable | None = None  # (positions, q, k, cos_sin_cache) -> (q, k)
    store_kvcache: Callable | None = None  # (key, value, k_cache, v_cache, slot_mapping) -> None
    attention_prologue: Callable | None = None  # QK-norm, RoPE and the store in one kernel (triton/attention_prologue)
    paged_decode: Callable | None = None  # (q, k_cache, v_cache, context_lens, block_tables, scale); None: backend's
    draw: Callable | None = None  # (logits, temperatures, seed, out) -> tokens: the sampler's draw (triton/sampler)
    linear: Callable | None = None  # (x, weight, bias, packed) -> y: through the packed weight (cpu/linear.py)
    pack_linear: Callable | None = None  # (weight) -> packed weight or None: once, after the load

    def bind(self, kernel: Callable | None, definition: Callable, token_args: int = 1) -> Callable:
        """What a layer calls: the engine's `kernel`, else the torch `definition` (through torch.compile where this
        table compiles; its first `token_args` tensor arguments have the token count as dim 0)."""
        if kernel is not None:
            return kernel
        return compiled(definition, token_args) if self.compile else definition


TORCH = Ops()  # the torch definitions everywhere: what a layer built alone runs


def torch_backend() -> AttentionBackend:
    """What an Attention layer built alone gets: plain torch (kernels/attention_backend.py)."""
    return TorchBackend()


_override_impl: Ops | None = None  # tests: what `pick` returns instead of its choice (see `override`)


def pick(
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    *,
    backend: str = "torch",
    options: KernelOptions | None = None,
) -> Ops:
    """The kernels of an engine on `device` running `dtype` with attention `backend` (kernels/attention_backends.py)."""
    if _override_impl is not None:
        return _override_impl
    options = options or KernelOptions()
    device = torch.device(device)
    cuda = device.type == "cuda"
    triton = cuda or options.triton_on_cpu  # our Triton kernels take this device's tensors
    ours = options.compile is None  # the small ops: our kernels, unless torch.compile or eager torch is asked for
    cpp = None
    if not cuda:
        from minivllm.kernels.cpu import linear as cpu_linear
        from minivllm.kernels.cpu import ops as cpp_ops

        cpp_ops.log_choice(options.cpu_ops)  # the C++ operators, or the torch ops
        if options.cpu_ops and ours and cpp_ops.loaded():
            cpp = cpp_ops
    name = "+".join(n for n, on in (("triton", triton), ("c++", cpp is not None)) if on) or "torch"
    table = dict(name=name, compile=cuda if ours else options.compile)  # the torch definitions left: compiled on CUDA
    if not cuda and options.cpu_packed_linear:
        table.update(linear=cpu_linear.linear, pack_linear=cpu_linear.pack)
    if cpp is not None:
        names = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary", "store_kvcache")
        table.update({name: getattr(cpp, name) for name in names})
    if triton:  # before the C++ ones where both exist (triton_on_cpu)
        from minivllm.kernels.triton import activation, attention_prologue, layernorm, sampler, store_kvcache

        table.update(store_kvcache=store_kvcache.store_kvcache, draw=sampler.inverse_cdf_sample)
        if ours:
            table.update(rms_norm=layernorm.rms_norm, add_rms_norm=layernorm.add_rms_norm)
            table.update(silu_and_mul=activation.silu_and_mul)
        if options.fused_prologue:
            table.update(attention_prologue=partial(attention_prologue.attention_prologue, use_pdl=options.pdl))
    if backend in ("fa4", "flash_attn") and options.decode_kernel == "triton":
        from minivllm.kernels.triton.paged_decode import paged_decode

        table.update(paged_decode=partial(paged_decode, use_pdl=options.pdl))
    elif backend == "torch" and cpp is not None:
        table.update(paged_decode=cpp.checked_paged_decode)
    return Ops(**table)


@contextmanager
def override(ops: Ops):
    """Tests: every `pick` in the block returns `ops` (engines started in the block keep it after)."""
    global _override_impl
    old, _override_impl = _override_impl, ops
    try:
        yield ops
    finally:
        _override_impl = old
