"""Chapter 02: the cos/sin cache (RotaryEmbedding.__init__), apply_rotary_emb and rotary
(minivllm/layers/rotary_embedding.py), fp32 and bf16, positions up to a few thousand."""

import math

import pytest
import torch

from helpers.course import DTYPES, assert_close, odd_size, seeded
from minivllm.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb, rotary

IDS = ["fp32", "bf16"]
BASE = 10000.0


def exact_cache(head_dim: int, max_pos: int) -> torch.Tensor:
    """(max_pos, 1, head_dim) fp64: cos(t * base^(-2i/d)) then sin."""
    inv = BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)[:, None, :]


def exact_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.double().chunk(2, dim=-1)
    cos, sin = cos.double(), sin.double()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def fp32_cache(head_dim: int, max_pos: int) -> torch.Tensor:
    """The reference's own fp32 formula: its error against fp64 sets the tolerance (a pow(base, -2i/d) passes)."""
    inv = 1.0 / (BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float)[:, None] * inv[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)[:, None, :]


def test_cos_sin_cache():
    head_dim, max_pos = 2 * odd_size(seeded(0), 5, 40), 3001
    rope = RotaryEmbedding(head_dim, head_dim, max_pos, BASE)
    got, oracle = rope.cos_sin_cache, fp32_cache(head_dim, max_pos)
    assert_close(got, exact_cache(head_dim, max_pos), "RotaryEmbedding.__init__", "cos_sin_cache", oracle=oracle)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_apply_rotary_emb(dtype):
    gen = seeded(4)
    n, heads, half = odd_size(gen, 5, 50), 3, odd_size(gen, 5, 40)
    x = torch.randn(n, heads, 2 * half, generator=gen).to(dtype)
    angle = torch.rand(n, 1, half, generator=gen, dtype=torch.float64) * 2 * math.pi
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)  # a bf16 model's cache is bf16
    got = apply_rotary_emb(x, cos, sin)
    assert_close(got, exact_rotate(x, cos, sin), "apply_rotary_emb", "rotated x", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rotary(dtype):
    gen = seeded(5)
    head_dim, max_pos = 2 * odd_size(gen, 5, 30), 777
    n = odd_size(gen, 5, 60)
    cache = exact_cache(head_dim, max_pos).to(dtype)
    positions = torch.randint(0, max_pos, (n,), generator=gen)  # unsorted, repeated: a batch of sequences
    q = torch.randn(n, 6, head_dim, generator=gen).to(dtype)
    k = torch.randn(n, 3, head_dim, generator=gen).to(dtype)
    got_q, got_k = rotary(positions, q, k, cache)
    cos, sin = cache[positions].chunk(2, dim=-1)
    assert_close(got_q, exact_rotate(q, cos, sin), "rotary", "query", dtype=dtype)
    assert_close(got_k, exact_rotate(k, cos, sin), "rotary", "key", dtype=dtype)


def test_module_forward():
    head_dim = 2 * odd_size(seeded(6), 5, 30)
    rope = RotaryEmbedding(head_dim, head_dim, 300, BASE)
    positions = torch.tensor([0, 1, 299, 5])
    q, k = torch.randn(4, 2, head_dim), torch.randn(4, 1, head_dim)
    got_q, got_k = rope(positions, q, k)
    cos, sin = exact_cache(head_dim, 300)[positions].chunk(2, dim=-1)
    cos32, sin32 = fp32_cache(head_dim, 300)[positions].chunk(2, dim=-1)
    for what, x, got in (("query", q, got_q), ("key", k, got_k)):
        oracle = exact_rotate(x, cos32, sin32).float()
        assert_close(got, exact_rotate(x, cos, sin), "RotaryEmbedding.__init__", f"forward's {what}", oracle=oracle)
