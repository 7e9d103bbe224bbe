"""Engine configuration (nano-vllm's config.py): one dataclass, checked on construction (engine_args.py)."""

from dataclasses import dataclass, field, fields

import torch
from transformers import PretrainedConfig

from minivllm.checkpoint import load_hf_config
from minivllm.frontend.engine_args import check_config, check_model_fits, vllm_engine_args
from minivllm.kernels.table import KernelOptions


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
    attention_backend: str | None = None  # None: fastest available (see layers/attention_backend.py)
    device: str = "auto"  # auto: CUDA if there is a GPU for every TP rank, else CPU
    seed: int = 0
    tokenizer: str | None = None  # a tokenizer directory other than the model's
    kernels: KernelOptions = field(default_factory=KernelOptions)  # which kernel families run (a dict works too)
    hf_config: PretrainedConfig | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_config(self)
        self.kernels = KernelOptions.of(self.kernels)
        if self.device == "auto":
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            self.device = "cuda" if gpus >= self.tensor_parallel_size else "cpu"
        self.hf_config = self.hf_config or load_hf_config(self.model)
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        check_model_fits(self)

    def torch_dtype(self) -> torch.dtype:
        """The dtype the model runs in: `dtype`, or for "auto" the checkpoint's dtype on a GPU, float32 on CPU."""
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.device != "cuda":
            return torch.float32
        dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None) or torch.bfloat16
        return getattr(torch, dtype) if isinstance(dtype, str) else dtype

    @classmethod
    def from_engine_args(cls, model: str, **kwargs) -> "Config":
        kwargs = vllm_engine_args(kwargs)
        names = {f.name for f in fields(cls)} - {"model", "hf_config"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid ones are {sorted(names)}")
        return cls(model, **kwargs)
