"""Engine configuration (nano-vllm's config.py): one dataclass of the engine's arguments, checked on construction,
each error naming the argument. vLLM's other names for them are the front end's (frontend/engine_args.py)."""

import os
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from minivllm.checkpoint import load_hf_config
from minivllm.kernels.table import KernelOptions

POSITIVE = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "kvcache_block_size", "tensor_parallel_size")


@dataclass(slots=True)
class Config:
    model: str
    max_num_batched_tokens: int = 16384  # tokens per step; longer prompts are prefilled in chunks
    max_num_seqs: int = 512  # sequences running at once
    max_model_len: int = 4096  # prompt + generated tokens, capped by the model's positions
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory the engine may use (KV cache sized to fit)
    cpu_kvcache_bytes: int = 1 << 30  # on CPU, the KV cache's byte budget
    num_kvcache_blocks: int = -1  # > 0: exactly this many blocks (tests force pressure with it)
    kvcache_block_size: int = 256  # tokens per KV block
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # True: no CUDA graphs
    enable_prefix_caching: bool = True
    dtype: str = "auto"  # auto: the checkpoint's dtype on GPU, float32 on CPU
    attention_backend: str | None = None  # None: fastest available (kernels/attention_backends.py)
    device: str = "auto"  # auto: CUDA if there is a GPU for every TP rank, else CPU
    seed: int = 0
    tokenizer: str | None = None  # a tokenizer directory other than the model's
    kernels: KernelOptions = field(default_factory=KernelOptions)  # which kernel families run (a dict works too)
    hf_config: PretrainedConfig | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.check()
        self.kernels = KernelOptions.of(self.kernels)
        if self.device == "auto":
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            self.device = "cuda" if gpus >= self.tensor_parallel_size else "cpu"
        self.hf_config = self.hf_config or load_hf_config(self.model)
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        for name in ("num_attention_heads", "num_key_value_heads"):  # heads are sharded over the TP ranks
            n = getattr(self.hf_config, name, None) or self.hf_config.num_attention_heads
            if n % self.tensor_parallel_size:
                raise ValueError(f"tensor parallel size {self.tensor_parallel_size} does not divide {name} {n}")

    def check(self) -> None:
        """Raise naming the first bad value (before anything is loaded or spawned)."""
        if not os.path.isdir(self.model):
            raise FileNotFoundError(f"model directory {self.model!r} does not exist")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise FileNotFoundError(f"{self.model!r} has no config.json (expected a Hugging Face checkpoint directory)")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise FileNotFoundError(f"tokenizer directory {self.tokenizer!r} does not exist")
        for name in POSITIVE:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    def torch_dtype(self) -> torch.dtype:
        """The dtype the model runs in: `dtype`, or for "auto" the checkpoint's dtype on a GPU, float32 on CPU."""
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.device != "cuda":
            return torch.float32
        dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None) or torch.bfloat16
        return getattr(torch, dtype) if isinstance(dtype, str) else dtype
