"""Chapter 01: rms_norm, add_rms_norm and RMSNorm.forward (minivllm/layers/layernorm.py), fp32 and bf16."""

import pytest
import torch

from helpers.course import DTYPES, assert_close, odd_size, seeded
from minivllm.layers.layernorm import RMSNorm, add_rms_norm, rms_norm

EPS = 1e-6
IDS = ["fp32", "bf16"]


def inputs(dtype, seed=1):
    gen = seeded(seed)
    n, h = odd_size(gen, 3, 40), odd_size(gen, 40, 300)
    x = (torch.randn(n, h, generator=gen) * 3).to(dtype)
    residual = (torch.randn(n, h, generator=gen) * 3).to(dtype)
    # weights that are powers of two: the product with them is exact, so bf16 results round once
    weight = (2.0 ** torch.randint(-2, 3, (h,), generator=gen) * (torch.rand(h, generator=gen) < 0.8)).to(dtype)
    return x, residual, weight


def fp32_norm(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference's formula: in fp32, cast once, then the weight."""
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype) * weight


def exact_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm(dtype):
    x, _, weight = inputs(dtype)
    oracle = fp32_norm(x, weight, dtype)
    assert_close(rms_norm(x, weight, EPS), exact_norm(x, weight), "rms_norm", "output", oracle=oracle, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_add_rms_norm(dtype):
    x, residual, weight = inputs(dtype, seed=2)
    s = x.double() + residual.double()
    out, new_residual = add_rms_norm(x, residual, weight, EPS)
    assert_close(new_residual, s, "add_rms_norm", "the new residual (x + residual)", dtype=dtype)
    oracle = fp32_norm(x.float() + residual.float(), weight, dtype)
    assert_close(out, exact_norm(s, weight), "add_rms_norm", "the normalised sum", oracle=oracle, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_module_forward(dtype):
    x, residual, weight = inputs(dtype, seed=3)
    norm = RMSNorm(x.shape[-1], eps=EPS).to(dtype)
    norm.weight.data.copy_(weight)
    assert_close(norm(x), exact_norm(x, weight), "RMSNorm.forward", "forward(x)", dtype=dtype)
    out, new_residual = norm(x, residual)
    s = x.double() + residual.double()
    assert_close(new_residual, s, "RMSNorm.forward", "forward(x, residual)[1]", dtype=dtype)
    assert_close(out, exact_norm(s, weight), "RMSNorm.forward", "forward(x, residual)[0]", dtype=dtype)


def test_module_rejects_wrong_shapes():
    norm = RMSNorm(7)
    with pytest.raises(ValueError, match="7"):
        norm(torch.ones(2, 5))
    with pytest.raises(ValueError, match="residual"):
        norm(torch.ones(2, 7), torch.ones(3, 7))
