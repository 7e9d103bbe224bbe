"""A GPU engine's start-up machinery, apart from the runner that calls it: the kernels compiled ahead, beside the
model's load (`CompileAhead`: FlashAttention-4's prefill kernel in a helper process or on a thread,
attention_compile.py; our Triton kernels on threads, triton_compile.py), and the warm-up (warmup.py). The runner
starts it with one call (`minivllm.kernels.begin_compile`) and waits once, before its warm-up. A CPU engine
compiles nothing ahead: its `CompileAhead` is empty."""

import time
from dataclasses import dataclass

import torch

from minivllm.config import Config
from minivllm.kernels import attention_backends
from minivllm.kernels.startup import attention_compile, triton_compile, warmup
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
        """Start the helper process (it pays its imports now, beside the engine's) and the Triton threads; then,
        once the attention backend is known (`attention_backends.select` imports FlashAttention-4 here), its compile
        on a thread, or stop the helper whose kernel is not wanted (FlashAttention-4 was expected but did not
        import)."""
        options = config.kernels
        where = attention_compile.where_to_compile(config, device, dtype, options.attention_compile, rank)
        ahead = cls(config, device, dtype, where)
        try:
            if where == "process":  # sent its request before this process imports FlashAttention-4
                ahead.attention = attention_compile.start(config, device, dtype, "process")
            if device.type == "cuda" and options.triton_compile:
                ahead.triton = triton_compile.start(config, device, dtype, rank)
            if attention_backends.select(device, dtype, config.attention_backend) != "fa4":
                ahead.cancel()
            elif where == "thread":
                ahead.attention = attention_compile.start(config, device, dtype, "thread")
        except BaseException:
            ahead.cancel()
            raise
        return ahead

    def wait(self) -> dict[str, float]:
        """Until every kernel compiled ahead is ready (before the warm-up, which then finds them compiled; a
        helper's memory is gone before the KV cache takes what is left of the GPU; a thread's errors raise here).
        Returns the seconds waited per compile that ran ("triton_compile", "attention_process" or
        "attention_thread")."""
        seconds = {}
        if self.triton is not None:
            seconds["triton_compile"] = timed(self.wait_triton, self.device)
        if self.attention is not None:
            key = f"attention_{self.attention.where}"  # (named first: the wait lets go of self.attention)
            seconds[key] = timed(self.wait_attention, self.device)
        return seconds

    def wait_triton(self) -> None:
        if self.triton is not None:
            self.triton.wait()

    def wait_attention(self) -> None:
        if self.attention is not None:
            compile_ahead, self.attention = self.attention, None
            compile_ahead.wait()

    @staticmethod
    def warmup_model(runner) -> None:
        """The largest prefill and sampler, before the KV cache (GPU; warmup.py)."""
        warmup.warmup_model(runner)

    @staticmethod
    def warmup_attention(runner) -> None:
        """A prefill over the cache, once the cache is there (GPU; warmup.py)."""
        warmup.warmup_attention(runner)

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
