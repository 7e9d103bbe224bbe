"""minivllm: a small, readable vLLM-style inference engine (nano-vllm's design), CPU-first."""

import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run through the interpreter on CPU. It must be set before any @triton.jit runs,
    # and only without CUDA (on a GPU it would also slow torch.compile's own Triton kernels).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minivllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in transformers: import it on first use, so `import minivllm.layers...` stays quick
    # (every spawned tensor-parallel process and notebook kernel imports the package)
    if name == "LLM":
        from minivllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
