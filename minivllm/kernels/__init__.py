"""The kernels an engine runs, chosen once when it starts: `pick(device, dtype, backend=..., options=...)` returns an
`Ops` table, which the runner gives to the model when it builds it (`Qwen3ForCausalLM(hf_config, ops=ops, ...)`);
each layer binds what it needs in its constructor (vLLM's `CustomOp`, tiny-llm's constructor flags): its forward is
its torch definition, or one call to the kernel it was given. An entry that is None means "the torch definition".

- CUDA: our Triton kernels (`kernels/triton/`) for the norms, SiLU-mul, the fused attention prologue, the KV-cache
  store, paged decode with the flash backends, and the sampler's draw. nano-vllm uses @torch.compile for the small
  ops; our kernels are no slower on a GPU and every process skips dynamo's import and tracing at start (~2-3 s
  with a warm cache). The torch definitions that still run there (RoPE outside the fused prologue) go through
  torch.compile (`Ops.bind`).
- CPU: the C++ operators (`kernels/cpu/`) for the norms, RoPE, SiLU-mul, the store and paged decode when this
  machine has built them, else the torch definitions, eager (inductor's C++ build would cost more than it saves
  in a short run); the linear layers through oneDNN with their weights packed once at load.
  `KernelOptions.triton_on_cpu` runs the GPU path's Triton kernels through the interpreter.

`KernelOptions` (the engine's `Config.kernels`) are measurement and debugging knobs: each turns one kernel family
off. A layer built alone gets `TORCH`; a test builds it with another table (`ops=pick(...)`), or forces what `pick`
returns to the engines it starts with `override` (nanochat's `_override_impl`). `attention_backends` is the attention's
one decision (`select`) and its backend objects (`create`); `begin_compile` is the GPU start-up's seam: the kernels
compiled beside the model's load (kernels/startup/)."""

import torch

from minivllm.kernels import attention_backends
from minivllm.kernels.table import TORCH, KernelOptions, Ops, compiled, override, pick

__all__ = [
    "TORCH",
    "KernelOptions",
    "Ops",
    "attention_backends",
    "begin_compile",
    "compiled",
    "decode_graph_variant",
    "override",
    "pick",
]


def begin_compile(config, device: torch.device, dtype: torch.dtype, rank: int):
    """Start compiling, beside the model's load, the kernels the first steps would otherwise compile (a GPU engine:
    FlashAttention-4's prefill kernel in a helper process or on a thread, our Triton kernels on threads; a CPU
    engine compiles nothing). Returns a `kernels.startup.CompileAhead`: `wait()` before the warm-up, `cancel()`
    when the start-up fails."""
    from minivllm.kernels.startup import CompileAhead

    return CompileAhead.start(config, device, dtype, rank)


def decode_graph_variant(batch: int, num_kv_heads: int) -> tuple[int, bool]:
    """Which compiled kernels a decode graph of `batch` sequences launches: the same for two batch sizes unless
    the decode attention's split count differs (its split and combine kernels) or one of them is 1 (Triton
    specialises integer arguments equal to 1). The graph capture warms up each variant once (engine/cuda_graphs.py)."""
    from minivllm.kernels.triton.paged_decode import num_splits

    return num_splits(batch, num_kv_heads), batch == 1
