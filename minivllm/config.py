"""Engine configuration (nano-vllm's config.py): one dataclass, validated on construction."""

import json
import os
from dataclasses import dataclass, field, fields

import torch

# AutoTokenizer's modules are imported with the engine, not at its first tokenizer: a form that imported them there
# measured ~5 s more in the engine's start on the H200, its import of FlashAttention-4 then loading what this import
# had loaded before it (benchmarks/NOTES.md, change 30)
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from minivllm.kernels import KernelOptions

# what the engine reads from a checkpoint's config.json (the model's shape, its norm, activation and RoPE)
ENGINE_KEYS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
    "tie_word_embeddings",
)


def load_hf_config(model: str) -> PretrainedConfig:
    """The checkpoint's configuration. When its config.json names every field the engine reads (ENGINE_KEYS and
    the RoPE base), a plain `PretrainedConfig` holding exactly those values: transformers' model-specific classes
    (LlamaConfig, Qwen3Config) add nothing then, and loading one costs ~1 s on a 2-core CPU (it validates
    `hidden_act` by importing transformers' activations, which import torch.distributed.tensor; README). A file
    that leaves a field to its model's defaults goes through AutoConfig, whose class supplies them."""
    with open(os.path.join(model, "config.json")) as f:
        values = json.load(f)
    rope_base = "rope_theta" in (values.get("rope_parameters") or {}) or "rope_theta" in values
    if all(k in values for k in ENGINE_KEYS) and rope_base:
        return PretrainedConfig(**values)
    return AutoConfig.from_pretrained(model)


def load_tokenizer(model: str, hf_config: PretrainedConfig):
    """The checkpoint's tokenizer. AutoTokenizer reads the model's config to choose a class; it is handed ours
    (not loaded a second time through AutoConfig) when tokenizer_config.json names the class itself."""
    path = os.path.join(model, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            if "tokenizer_class" in json.load(f):
                return AutoTokenizer.from_pretrained(model, config=hf_config)
    return AutoTokenizer.from_pretrained(model)


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
    kernels: KernelOptions = field(default_factory=KernelOptions)  # which kernel families run (a dict works too)
    hf_config: PretrainedConfig | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not os.path.isdir(self.model):
            raise FileNotFoundError(f"model directory {self.model!r} does not exist")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise FileNotFoundError(f"{self.model!r} has no config.json (expected a Hugging Face checkpoint directory)")
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_model_len",
            "kvcache_block_size",
            "tensor_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "auto":
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            self.device = "cuda" if gpus >= self.tensor_parallel_size else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        self.kernels = KernelOptions.of(self.kernels)
        self.hf_config = self.hf_config or load_hf_config(self.model)
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        for name in ("num_attention_heads", "num_key_value_heads"):  # heads are sharded: check before spawning
            n = getattr(self.hf_config, name, None) or self.hf_config.num_attention_heads
            if n % self.tensor_parallel_size:
                raise ValueError(f"tensor parallel size {self.tensor_parallel_size} does not divide {name} {n}")

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
        names = {f.name for f in fields(cls)} - {"model", "hf_config"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid ones are {sorted(names)}")
        return cls(model, **kwargs)
