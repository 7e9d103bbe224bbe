"""Chapter 08: the attention layer's forward (minivllm/layers/attention.py) and its backend's attend and
attend_paged (minivllm/kernels/attention_backend.py) over the
paged cache with the torch backend: a prefill of fresh prompts, a later chunk with decode rows first, a decode
step; the cache after each, fp32 and bf16."""

import pytest
import torch

from course.paged import attention_exact, attention_fp32, sizes
from helpers.course import DTYPES, assert_close, assert_exact, seeded
from minivllm.layers.attention import Attention
from minivllm.utils.context import reset_context, set_context

IDS = ["fp32", "bf16"]
BLOCK = 5


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


class Run:
    """Sequences of known K/V fed to one layer step by step; the truth is attention over each whole sequence."""

    def __init__(self, dtype, seed: int) -> None:
        gen = seeded(seed)
        self.hkv, group, self.d = sizes(gen)
        self.h, self.dtype = self.hkv * group, dtype
        self.layer = Attention(self.h, self.d, self.d**-0.5, self.hkv)
        shape = (12, BLOCK, self.hkv, self.d)
        self.layer.k_cache, self.layer.v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.tables = [[7, 2, 9], [4, 0, 11], [5, 1]]  # scattered blocks per sequence
        lens = [13, 9, 6]
        self.q = [torch.randn(n, self.h, self.d, generator=gen).to(dtype) for n in lens]
        self.k = [torch.randn(n, self.hkv, self.d, generator=gen).to(dtype) for n in lens]
        self.v = [torch.randn(n, self.hkv, self.d, generator=gen).to(dtype) for n in lens]

    def slots(self, i: int, a: int, b: int) -> list[int]:
        return [self.tables[i][t // BLOCK] * BLOCK + t % BLOCK for t in range(a, b)]

    def step(self, spans: list[tuple[int, int, int]], is_prefill: bool, paged: bool, decode_rows: int = 0):
        """spans: (sequence, first, end) of the tokens this step computes. Returns (got, exact, oracle)."""
        cat = lambda xs: torch.cat([x[a:b] for x, (i, a, b) in zip(xs, spans)])
        q = cat([self.q[i] for i, _, _ in spans])
        k, v = cat([self.k[i] for i, _, _ in spans]), cat([self.v[i] for i, _, _ in spans])
        news = [b - a for _, a, b in spans]
        width = max(len(self.tables[i]) for i, _, _ in spans)
        tables = i32([self.tables[i] + [-1] * (width - len(self.tables[i])) for i, _, _ in spans])
        set_context(
            is_prefill,
            cu_seqlens_q=i32([0, *torch.tensor(news).cumsum(0).tolist()]),
            cu_seqlens_k=i32([0, *torch.tensor([b for _, _, b in spans]).cumsum(0).tolist()]),
            max_seqlen_q=max(news),
            max_seqlen_k=max(b for _, _, b in spans),
            slot_mapping=i32(sum((self.slots(i, a, b) for i, a, b in spans), [])),
            context_lens=i32([b for _, _, b in spans]),
            block_tables=tables if paged or not is_prefill else None,
            num_decode_rows=decode_rows,
        )
        try:
            got = self.layer(q, k, v)
        finally:
            reset_context()
        scale = self.d**-0.5
        exact = [attention_exact(self.q[i][a:b], self.k[i][:b], self.v[i][:b], scale) for i, a, b in spans]
        oracle = [attention_fp32(self.q[i][a:b], self.k[i][:b], self.v[i][:b], scale) for i, a, b in spans]
        return got, torch.cat(exact), torch.cat(oracle)

    def check_cache(self, upto: dict[int, int], exercise: str, when: str) -> None:
        for i, n in upto.items():
            rows = self.slots(i, 0, n)
            got = self.layer.k_cache.flatten(0, 1)[rows]
            assert_exact(got, self.k[i][:n], exercise, f"{when}: the cached keys of sequence {i}")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_prefill_chunk_decode(dtype):
    run = Run(dtype, 50)
    # 1) prefill: sequence 0's first chunk (8 of 13) and all of sequence 2 (6), fresh keys only
    got, exact, oracle = run.step([(0, 0, 8), (2, 0, 5)], is_prefill=True, paged=False)
    assert_close(got, exact, "Attention.forward", "prefill of fresh prompts", oracle=oracle, dtype=dtype)
    run.check_cache({0: 8, 2: 5}, "Attention.forward", "after the prefill")
    # 2) a mixed step: sequence 2 decodes its 6th token (a decode row first), sequence 0's last chunk, sequence 1
    #    prefills from scratch; keys come from the cache
    got, exact, oracle = run.step([(2, 5, 6), (0, 8, 13), (1, 0, 9)], is_prefill=True, paged=True, decode_rows=1)
    assert_close(
        got,
        exact,
        "AttentionBackend.attend / attend_paged",
        "a later chunk with a decode row first",
        oracle=oracle,
        dtype=dtype,
    )
    run.check_cache({0: 13, 1: 9, 2: 6}, "Attention.forward", "after the chunk")
    # 3) decode: none of the three has a new token in this check, so re-read the last token of each
    got, exact, oracle = run.step([(0, 12, 13), (1, 8, 9), (2, 5, 6)], is_prefill=False, paged=True)
    assert_close(got, exact, "AttentionBackend.attend", "decode", oracle=oracle, dtype=dtype)
