"""minivllm: a small, readable vLLM-style inference engine (nano-vllm's design), CPU-first."""
import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run through the interpreter on CPU. It must be set before any @triton.jit runs,
    # and only without CUDA (on a GPU it would also slow torch.compile's own Triton kernels).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minivllm.llm import LLM  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]
