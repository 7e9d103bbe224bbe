"""Fixtures: tiny random checkpoints made once per test session, and an assert_close that reports errors."""

import pytest
import torch

from minivllm.testing.tiny_model import make_tiny_checkpoint

TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (1e-3, 1e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, atol=None, rtol=None):
    """Per-dtype tolerances (tiny-llm's habit); the message reports the max and mean absolute difference."""
    dtype = dtype or actual.dtype
    a, r = TOLERANCES[dtype]
    atol, rtol = atol if atol is not None else a, rtol if rtol is not None else r
    diff = (actual.double() - expected.double()).abs()
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.allclose(actual.double(), expected.double(), atol=atol, rtol=rtol), (
        f"max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e} (atol {atol}, rtol {rtol})"
    )


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_qwen3")), "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_qwen2")), "qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_checkpoint(
        str(tmp_path_factory.mktemp("tiny_llama")),
        "llama",
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=None,
        hidden_size=96,
        tie_word_embeddings=False,
    )
