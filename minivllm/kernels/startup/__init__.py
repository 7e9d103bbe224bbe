"""A GPU engine's start-up machinery, apart from the runner that calls it: the kernels compiled ahead, beside the
model's load (`CompileAhead`: FlashAttention-4's prefill kernel in a helper process or on a thread,
attention_compile.py; our Triton kernels on threads, triton_compile.py), and the warm-up (warmup.py). A CPU
engine compiles nothing ahead: its `CompileAhead` is empty."""

import time
from dataclasses import dataclass

import torch

from minivllm.config import Config
from minivllm.kernels.startup import attention_compile, triton_compile
from minivllm.kernels.startup.attention_compile import AttentionCompile
from minivllm.kernels.startup.triton_compile import TritonCompile


@dataclass
class CompileAhead:
    """The compiles under way while the runner loads the model; each wait returns at once when there is none."""

    config: Config
    device: torch.device
    dtype: torch.dtype
    where: str | None = None  # FlashAttention-4's compile: "process", "thread" or None (the warm-up compiles)
    attention: AttentionCompile | None = None
    triton: TritonCompile | None = None

    @classmethod
    def start(cls, config: Config, device: torch.device, dtype: torch.dtype, rank: int) -> "CompileAhead":
        """Start the helper process (it pays its imports now, beside the engine's) and the Triton threads."""
        options = config.kernels
        where = attention_compile.where_to_compile(config, device, dtype, options.attention_compile, rank)
        ahead = cls(config, device, dtype, where)
        if where == "process":  # sent its request before `attention_backend.select` imports FlashAttention-4 here
            ahead.attention = attention_compile.start(config, device, dtype, "process")
        if device.type == "cuda" and options.triton_compile:
            ahead.triton = triton_compile.start(config, device, dtype, rank)
        return ahead

    def backend_chosen(self, backend: str) -> None:
        """After the attention backend's import: FlashAttention-4's compile on a thread now, or stop the helper
        whose kernel is not wanted (FlashAttention-4 was expected but did not import)."""
        if backend != "fa4":
            self.cancel()
        elif self.where == "thread":
            self.attention = attention_compile.start(self.config, self.device, self.dtype, "thread")

    def wait_triton(self) -> None:
        if self.triton is not None:
            self.triton.wait()

    def wait_process(self) -> None:
        """Before the KV cache takes what is left of the GPU: the helper's memory must be gone."""
        if self.attention is not None and self.attention.where == "process":
            self.wait_attention()

    def wait_attention(self) -> None:
        if self.attention is not None:
            compile_ahead, self.attention = self.attention, None
            compile_ahead.wait()

    def cancel(self) -> None:
        """A start-up that fails (or no longer wants FlashAttention-4's kernel) leaves no helper compiling."""
        if self.attention is not None:
            self.attention.cancel()
            self.attention, self.where = None, None


def timed(fn, device: torch.device) -> float:
    """Seconds `fn()` takes, its GPU work included."""
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t
