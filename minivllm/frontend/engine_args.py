"""The engine's arguments as users pass them to `LLM(...)`: vLLM's names mapped to ours (`block_size`), those
that do nothing here accepted with a warning that says so (as vLLM does for options that do not apply), and the
values checked, each error naming its argument."""

import logging
import os

import torch

logger = logging.getLogger("minivllm")

RENAMED = {"block_size": "kvcache_block_size"}  # vLLM's name -> ours
IGNORED = {  # vLLM's arguments that have no effect here -> why
    "swap_space": "preempted sequences are recomputed, never swapped to CPU memory",
    "disable_log_stats": "the offline engine logs no statistics",
    "trust_remote_code": "only minivllm's built-in architectures load; no checkpoint code is run",
}


def vllm_engine_args(kwargs: dict) -> dict:
    """kwargs with vLLM's names renamed and the arguments that do nothing here dropped (with a warning)."""
    out = {}
    for name, value in kwargs.items():
        if name in IGNORED:
            logger.warning("%s=%r has no effect in minivllm: %s", name, value, IGNORED[name])
        elif name in RENAMED:
            if RENAMED[name] in kwargs:
                raise TypeError(f"give {name} or {RENAMED[name]}, not both")
            out[RENAMED[name]] = value
        else:
            out[name] = value
    return out


def check_config(c) -> None:
    """Raise naming the first bad value of Config `c` (before anything is loaded or spawned)."""
    if not os.path.isdir(c.model):
        raise FileNotFoundError(f"model directory {c.model!r} does not exist")
    if not os.path.isfile(os.path.join(c.model, "config.json")):
        raise FileNotFoundError(f"{c.model!r} has no config.json (expected a Hugging Face checkpoint directory)")
    if c.tokenizer is not None and not os.path.isdir(c.tokenizer):
        raise FileNotFoundError(f"tokenizer directory {c.tokenizer!r} does not exist")
    for name in (
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_model_len",
        "kvcache_block_size",
        "tensor_parallel_size",
    ):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
    if not 0 < c.gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}")
    if c.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {c.device!r}")
    if c.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    if c.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {c.dtype!r}")


def check_model_fits(c) -> None:
    """The model's heads are sharded over the tensor-parallel ranks: each count must divide evenly."""
    for name in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(c.hf_config, name, None) or c.hf_config.num_attention_heads
        if n % c.tensor_parallel_size:
            raise ValueError(f"tensor parallel size {c.tensor_parallel_size} does not divide {name} {n}")
