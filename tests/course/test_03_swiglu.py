"""Chapter 03: silu_and_mul and SiluAndMul.forward (minivllm/layers/activation.py), fp32 and bf16."""

import pytest
import torch
import torch.nn.functional as F

from helpers.course import DTYPES, assert_close, odd_size, seeded
from minivllm.layers.activation import SiluAndMul, silu_and_mul

IDS = ["fp32", "bf16"]


def inputs(dtype, seed):
    gen = seeded(seed)
    return (torch.randn(odd_size(gen, 3, 40), 2 * odd_size(gen, 20, 200), generator=gen) * 4).to(dtype)


def exact(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)  # front half gate, back half up
    return gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_and_mul(dtype):
    x = inputs(dtype, 7)
    gate, up = x.chunk(2, dim=-1)
    oracle = F.silu(gate) * up  # the reference's own rounding (twice in bf16) sets the bar
    assert_close(silu_and_mul(x), exact(x), "silu_and_mul", "output", oracle=oracle, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_module_forward(dtype):
    x = inputs(dtype, 8)
    gate, up = x.chunk(2, dim=-1)
    assert_close(SiluAndMul()(x), exact(x), "SiluAndMul.forward", "output", oracle=F.silu(gate) * up, dtype=dtype)
    with pytest.raises(ValueError, match="odd"):
        SiluAndMul()(torch.ones(2, 5))
