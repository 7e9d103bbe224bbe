"""The kernels an engine runs, chosen once when it starts (vLLM's `CustomOp`, tiny-llm's constructor flags):
`pick(device, dtype, backend=..., options=...)` returns an `Ops` table (kernels/table.py) that the runner gives to the
model when it builds it; each layer binds what it needs in its constructor, so its forward is its torch definition or
one call to the kernel it was given.

- CUDA: our Triton kernels (`kernels/triton/`) for the norms, SiLU-mul, the fused attention prologue, the KV-cache
  store, paged decode with the flash backends, and the sampler's draw; the torch definitions that still run there
  (RoPE outside the prologue) go through torch.compile. nano-vllm compiles the small ops too; our kernels are no
  slower, and a process skips dynamo's import and tracing at start (~2-3 s).
- CPU: the C++ operators (`kernels/cpu/`) for the norms, RoPE, SiLU-mul, the store and paged decode where this
  machine built them, else the torch definitions, eager; the linear layers through oneDNN, weights packed at load.

`attention_backends` is the attention's one decision (`select`) and its backend objects (`create`); `begin_compile`
starts compiling a GPU engine's kernels beside the model's load (kernels/startup/)."""

import torch

from minivllm.kernels import attention_backends
from minivllm.kernels.table import KernelOptions, override, pick

__all__ = ["KernelOptions", "attention_backends", "begin_compile", "decode_graph_variant", "override", "pick"]


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
