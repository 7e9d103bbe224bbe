"""tests/helpers/gpu.py: on a GPU with MINIVLLM_REQUIRE_FA4=1 a FlashAttention-4 that cannot run is an error,
never a quiet fallback; MINIVLLM_REQUIRE_GPUS asks for a number of GPUs. The GPU itself is faked here (CUDA
present, which backends import), so the rule is checked on any machine."""

import pytest
import torch

from helpers import gpu


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA machine whose available attention backends the test sets."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu, "why_no_fa4", lambda: "faked: flash_attn.cute does not import")

    def with_backends(*names):
        monkeypatch.setattr(gpu.attention_backends, "available", lambda device, dtype=None: [*names, "torch"])

    return with_backends


def test_require_fa4_parses_only_0_and_1(monkeypatch):
    monkeypatch.delenv(gpu.REQUIRE_FA4, raising=False)
    assert gpu.fa4_required() is False
    monkeypatch.setenv(gpu.REQUIRE_FA4, "1")
    assert gpu.fa4_required() is True
    monkeypatch.setenv(gpu.REQUIRE_FA4, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        gpu.fa4_required()


def test_missing_fa4_is_an_error_only_when_required(fake_gpu, monkeypatch):
    fake_gpu("flash_attn")  # a GPU with flash-attn but no FlashAttention-4
    monkeypatch.delenv(gpu.REQUIRE_FA4, raising=False)
    assert gpu.flash_backends() == ["flash_attn"]  # a user's box: use what is there
    monkeypatch.setenv(gpu.REQUIRE_FA4, "1")
    with pytest.raises(RuntimeError, match="MINIVLLM_REQUIRE_FA4=1 but FlashAttention-4 cannot run here: faked"):
        gpu.flash_backends()
    fake_gpu("fa4", "flash_attn")
    assert gpu.flash_backends() == ["fa4", "flash_attn"]


def test_no_cuda_means_no_flash_backend_and_no_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(gpu.REQUIRE_FA4, "1")
    assert gpu.flash_backends() == []  # the CPU cells say what they skipped


def test_require_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("MINIVLLM_REQUIRE_GPUS", raising=False)
    assert gpu.require_gpus() == 0
    monkeypatch.setenv("MINIVLLM_REQUIRE_GPUS", "2")
    with pytest.raises(RuntimeError, match="MINIVLLM_REQUIRE_GPUS=2 but this machine has 1 GPU"):
        gpu.require_gpus()
