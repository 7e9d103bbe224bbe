"""Chapter 07: attention over the paged cache (minivllm/kernels/torch_attention.py: the causal mask, the gather,
prefill over fresh keys and with a cached prefix, decode) and the paged decode kernel with its online softmax
and split combine (minivllm/kernels/triton/paged_decode.py, natively on a GPU, through Triton's interpreter on a
CPU), fp32 and bf16.
Scores that overflow exp in fp32 catch an online softmax without its running max."""

import pytest
import torch

from course.paged import attention_bf16_probs, attention_exact, attention_fp32, make_paged, sizes
from helpers.course import DTYPES, KERNEL_DEVICE, assert_close, assert_exact, odd_size, seeded
from minivllm.kernels import torch_attention as ta
from minivllm.kernels.triton.paged_decode import paged_decode

IDS = ["fp32", "bf16"]


def test_causal_mask():
    for q_len, k_len in ((1, 1), (3, 3), (3, 8), (1, 7)):
        want = torch.tensor([[j <= i + k_len - q_len for j in range(k_len)] for i in range(q_len)])
        assert_exact(ta.causal_mask(q_len, k_len), want, "causal_mask", f"({q_len} queries, {k_len} keys)")


def test_gather_paged():
    gen = seeded(40)
    p = make_paged(gen, [odd_size(gen, 6, 30), 1, 5], 3, 6, torch.float32)
    for i, n in enumerate(p.lens):
        want, _ = p.keys(i)
        assert_exact(ta.gather_paged(p.k_cache, p.block_tables[i], n), want, "gather_paged", f"sequence {i}'s keys")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_varlen_attention(dtype):
    gen = seeded(41)
    hkv, group, d = sizes(gen)
    lens = [odd_size(gen, 3, 20), 1, odd_size(gen, 3, 20)]
    n = sum(lens)
    q = torch.randn(n, hkv * group, d, generator=gen).to(dtype)
    k, v = torch.randn(n, hkv, d, generator=gen).to(dtype), torch.randn(n, hkv, d, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    got = ta.varlen_attention(q, k, v, cu, d**-0.5)
    parts = [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    exact = torch.cat([attention_exact(q[a:b], k[a:b], v[a:b], d**-0.5) for a, b in parts])
    oracle = torch.cat([attention_fp32(q[a:b], k[a:b], v[a:b], d**-0.5) for a, b in parts])
    assert_close(got, exact, "varlen_attention", "prefill over fresh keys", oracle=oracle, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_paged_prefill_with_prefix(dtype):
    gen = seeded(42)
    hkv, group, d = sizes(gen)
    lens = [odd_size(gen, 8, 30), odd_size(gen, 8, 30), 3]
    new = [odd_size(gen, 3, 7), 1, 3]  # queries: the last tokens of each context (a prefix hit, a later chunk)
    p = make_paged(gen, lens, hkv, d, dtype)
    q = torch.randn(sum(new), hkv * group, d, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    got = ta.paged_prefill_attention(
        q, p.k_cache, p.v_cache, cu, torch.tensor(lens, dtype=torch.int32), p.block_tables, d**-0.5
    )
    exact, oracle = [], []
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        k, v = p.keys(i)
        exact.append(attention_exact(q[a:b], k, v, d**-0.5))
        oracle.append(attention_fp32(q[a:b], k, v, d**-0.5))
    assert_close(
        got,
        torch.cat(exact),
        "paged_prefill_attention",
        "queries over a cached prefix",
        oracle=torch.cat(oracle),
        dtype=dtype,
    )


def run_kernel(p, q, ctx, scale, splits: int) -> torch.Tensor:
    """paged_decode on KERNEL_DEVICE, the result back on the CPU beside the truth."""
    on = lambda t: t.to(KERNEL_DEVICE)
    tables = on(p.block_tables.clamp(min=0))
    out = paged_decode(on(q), on(p.k_cache), on(p.v_cache), on(ctx), tables, scale, splits=splits, block_n=16)
    return out.cpu()


def toward_zero(x: torch.Tensor) -> torch.Tensor:
    """x cast to bf16 by dropping the low 16 bits of its fp32 form (what Triton's interpreter does)."""
    bits = x.float().view(torch.int32) & -65536  # 0xFFFF0000
    return bits.view(torch.float32).to(torch.bfloat16)


def per_sequence(attention, p, q) -> torch.Tensor:
    """`attention(q, k, v, scale)` of each sequence's query over its keys, contiguous (paged.py), stacked."""
    d = q.shape[-1]
    return torch.stack([attention(q[i : i + 1], *p.keys(i), d**-0.5)[0] for i in range(len(p.lens))])


def decode_case(dtype, seed: int, scale_values: float = 1.0, lens=None):
    gen = seeded(seed)
    hkv, group, d = sizes(gen)
    lens = lens or [odd_size(gen, 3, 40), 1, odd_size(gen, 40, 90), 7]
    p = make_paged(gen, lens, hkv, d, dtype, scale_values=scale_values)
    q = (torch.randn(len(lens), hkv * group, d, generator=gen) * scale_values).to(dtype)
    exact, oracle = per_sequence(attention_exact, p, q), per_sequence(attention_fp32, p, q)
    return p, q, torch.tensor(lens, dtype=torch.int32), d**-0.5, exact, oracle


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_paged_decode_attention(dtype):
    p, q, ctx, scale, exact, oracle = decode_case(dtype, 43)
    g = ta.decode_gather(q, p.k_cache, p.v_cache, ctx, p.block_tables)
    bs = p.k_cache.shape[1]
    for b, n in enumerate(ctx.tolist()):
        want = torch.tensor([int(p.block_tables[b, t // bs]) * bs + t % bs for t in range(n)])
        assert_exact(g.slots[b, :n], want, "decode_gather", f"slots of sequence {b}'s keys")
        assert_exact(g.mask[b, 0, 0], torch.arange(g.mask.shape[-1]) < n, "decode_gather", f"mask of sequence {b}")
    cache = {}
    for call in ("first call", "second call (the gather kept in `cache`)"):
        got = ta.paged_decode_attention(q, p.k_cache, p.v_cache, ctx, p.block_tables, scale, cache)
        assert_close(got, exact, "paged_decode_attention", f"decode, {call}", oracle=oracle, dtype=dtype)


@pytest.mark.parametrize("splits", [1, 3], ids=["one split", "three splits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_paged_decode_kernel(dtype, splits):
    p, q, ctx, scale, exact, oracle = decode_case(dtype, 44)
    got = run_kernel(p, q, ctx, scale, splits)
    exercise = "combine_splits_kernel" if splits > 1 else "paged_decode_kernel"
    if dtype == torch.bfloat16 and KERNEL_DEVICE == "cpu":  # the interpreter casts to bf16 toward zero
        oracle = toward_zero(exact)
    elif dtype == torch.bfloat16:  # a GPU's bf16 kernel weights the values with bf16 probabilities (tl.dot's inputs)
        oracle = per_sequence(attention_bf16_probs, p, q)
    assert_close(got, exact, exercise, f"decode over {splits} split(s)", oracle=oracle, dtype=dtype)


@pytest.mark.parametrize("splits", [1, 2], ids=["one split", "two splits"])
def test_paged_decode_kernel_scores_beyond_exp_range(splits):
    """Scores of several hundred: exp overflows fp32 unless the running max is subtracted first."""
    p, q, ctx, scale, exact, oracle = decode_case(torch.float32, 45, scale_values=12.0, lens=[67, 33])
    keys = p.k_cache.flatten(0, 1).double().repeat_interleave(q.shape[1] // p.k_cache.shape[2], dim=1)
    assert torch.einsum("bhd,shd->bhs", q.double(), keys).max() * scale > 100  # exp(100) > fp32's largest
    got = run_kernel(p, q, ctx, scale, splits)
    exercise = "paged_decode_kernel" if splits == 1 else "paged_decode_kernel / combine_splits_kernel"
    assert_close(
        got, exact, exercise, "scores up to a few hundred (exp overflows without the running max)", oracle=oracle
    )
