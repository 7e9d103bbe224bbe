"""The kernels an engine runs, chosen once when it starts (vLLM's `CustomOp`): `pick` returns the `Ops` table
(kernels/table.py, which says what each device gets) that the runner gives to the model; each layer binds what it
needs in its constructor. `attention_backends` is the attention's one decision (`select`) and its backend objects
(`create`); `begin_compile` starts compiling a GPU engine's kernels beside the model's load (kernels/startup/)."""

import torch

from minivllm.kernels import attention_backends
from minivllm.kernels.table import KernelOptions, override, pick

__all__ = ["KernelOptions", "attention_backends", "begin_compile", "decode_graph_variant", "override", "pick"]


def begin_compile(config, device: torch.device, dtype: torch.dtype, rank: int):
    """A `kernels.startup.CompileAhead` compiling what the first steps would (nothing on CPU): `wait()` before the
    warm-up, `cancel()` when the start-up fails."""
    from minivllm.kernels.startup import CompileAhead

    return CompileAhead.start(config, device, dtype, rank)


def decode_graph_variant(batch: int, num_kv_heads: int) -> tuple[int, bool]:
    """Which compiled kernels a decode graph of `batch` sequences launches: its decode split count, and batch 1
    (Triton specialises an integer equal to 1). The graph capture warms each variant up once."""
    from minivllm.kernels.triton.paged_decode import num_splits

    return num_splits(batch, num_kv_heads), batch == 1
