"""Engine arguments (minivllm/config.py), given to LLM(...): each bad value is refused before anything is
loaded, with an error naming it; `device="auto"` and `dtype="auto"` resolve as documented."""

import pytest
import torch

from minivllm import LLM
from minivllm.config import Config


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(gpu_memory_utilization=0), ValueError, r"gpu_memory_utilization must be in \(0, 1\], got 0"),
        (dict(gpu_memory_utilization=1.01), ValueError, r"gpu_memory_utilization must be in \(0, 1\], got 1.01"),
        (dict(gpu_memory_utilization=-0.5), ValueError, r"gpu_memory_utilization must be in \(0, 1\]"),
        (dict(device="tpu"), ValueError, "device must be auto, cpu or cuda, got 'tpu'"),
        (dict(dtype="int8"), ValueError, "dtype must be auto, float32, bfloat16 or float16, got 'int8'"),
        (dict(dtype="bf16"), ValueError, "dtype must be auto, float32, bfloat16 or float16, got 'bf16'"),
        (dict(kvcache_block_size=0), ValueError, "kvcache_block_size must be >= 1, got 0"),
        (dict(max_model_len=-1), ValueError, "max_model_len must be >= 1, got -1"),
        # 4 heads, 2 KV heads: 4 ranks divide the heads, not the KV heads
        (dict(tensor_parallel_size=4), ValueError, "tensor parallel size 4 does not divide num_key_value_heads 2"),
        (dict(tensor_parallel_size=3), ValueError, "tensor parallel size 3 does not divide num_attention_heads 4"),
        (dict(num_kvcache_block=8), TypeError, r"unknown engine argument\(s\) \['num_kvcache_block'\]"),
    ],
)
def test_bad_engine_arguments_are_named(tiny_qwen3, kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM(tiny_qwen3, **kwargs)


def test_cuda_without_a_gpu_is_refused(tiny_qwen3, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without CUDA
    with pytest.raises(ValueError, match="device='cuda' but no CUDA device is available"):
        LLM(tiny_qwen3, device="cuda")
    assert Config(tiny_qwen3).device == "cpu"  # auto


def test_auto_device_needs_a_gpu_for_every_rank(tiny_qwen3, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert Config(tiny_qwen3).device == "cuda"
    assert Config(tiny_qwen3, tensor_parallel_size=2).device == "cpu"  # one GPU, two ranks


def test_a_directory_without_config_json_is_named(tiny_qwen3, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no config.json \(expected a Hugging Face checkpoint"):
        LLM(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")  # weights alone are not a checkpoint either
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(tmp_path))


def test_auto_dtype_is_float32_on_cpu_and_the_checkpoints_on_a_gpu(tiny_qwen3, monkeypatch):
    assert Config(tiny_qwen3).torch_dtype() == torch.float32
    assert Config(tiny_qwen3, dtype="bfloat16").torch_dtype() == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # Config only: nothing touches the GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = Config(tiny_qwen3)
    config.hf_config.dtype = torch.bfloat16  # a checkpoint saved in bf16, as Qwen3's
    assert config.device == "cuda" and config.torch_dtype() == torch.bfloat16
    config.hf_config.dtype = "float16"  # as a string in older configs
    assert config.torch_dtype() == torch.float16
    assert Config(tiny_qwen3, dtype="float32").torch_dtype() == torch.float32
