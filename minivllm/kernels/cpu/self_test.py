"""The CPU operators' self-test, run in a fresh process on a new build before it is kept (build.py):
`python3 -m minivllm.kernels.cpu.self_test PATH` loads the library at PATH and checks each operator on small
inputs against its torch definition, and that a bad input raises ValueError (a library whose C++ runtime cannot
unwind into torch's crashes the process on a bad input instead); exits non-zero otherwise."""

import sys

import torch
import torch.nn.functional as F

from minivllm.kernels import torch_attention
from minivllm.layers import layernorm, rotary_embedding


def self_test(path: str) -> None:
    """Load the library at `path` and check each operator on small inputs against the torch definition, and
    that a bad input raises ValueError; raises AssertionError otherwise (python3 -m ... --self-test PATH)."""
    torch.ops.load_library(path)
    ops = torch.ops.minivllm
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g), torch.rand(64, generator=g) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), layernorm.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(ops.add_rms_norm(x, r, w, 1e-6)[0], layernorm.rms_norm(x + r, w, 1e-6))
    gate_up = torch.randn(3, 128, generator=g)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate_up[:, :64]) * gate_up[:, 64:])
    rope = rotary_embedding.RotaryEmbedding(64, 64, 16, 10000.0)
    q, k, pos = torch.randn(3, 4, 64, generator=g), torch.randn(3, 2, 64, generator=g), torch.tensor([0, 5, 15])
    for got, want in zip(
        ops.rotary(pos, q, k, rope.cos_sin_cache), rotary_embedding.rotary(pos, q, k, rope.cos_sin_cache)
    ):
        torch.testing.assert_close(got, want)
    k_cache, v_cache = torch.zeros(2, 4, 2, 64), torch.zeros(2, 4, 2, 64)
    ops.store_kvcache(k[:2], k[1:], k_cache, v_cache, torch.tensor([5, 2]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[0, 2], k[2])
    lens, tables = torch.tensor([6, 3], dtype=torch.int32), torch.tensor([[1, 0], [0, -1]], dtype=torch.int32)
    want = torch_attention.paged_decode_attention(q[:2], k_cache, v_cache, lens, tables, 0.125)
    torch.testing.assert_close(ops.paged_decode(q[:2], k_cache, v_cache, lens, tables, 0.125), want)
    try:
        ops.rotary(torch.tensor([0, 5, 16]), q, k, rope.cos_sin_cache)
    except ValueError as e:
        assert "position 16 outside" in str(e), e
    else:
        raise AssertionError("a position past the table raised nothing")


if __name__ == "__main__":
    self_test(sys.argv[1])
