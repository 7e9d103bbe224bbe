"""Attention over the paged KV cache (notebooks 07 and 08): every available backend
against a naive fp64 reference on ragged batches, the paged cache against a contiguous one, the prefix
path against a full recompute, the Attention layer's three paths end to end, and the input checks."""

import math

import pytest
import torch

import minivllm  # noqa: F401  (TRITON_INTERPRET=1 without CUDA, for store_kvcache)
from conftest import assert_close
from minivllm.kernels import attention_backends
from minivllm.kernels.torch_attention import gather_paged
from minivllm.layers.attention import Attention
from minivllm.utils.context import Context, reset_context, set_context

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEAD_DIM = 128 if DEVICE == "cuda" else 16  # FlashAttention kernels want a real head_dim; CPU stays small

# (q heads, kv heads, block size, sequence lengths): GQA 16/8 and 9/3, one long sequence among short ones
CASES = [
    (16, 8, 256, [2000, 1, 7, 33]),
    (16, 8, 16, [1, 5, 17, 64, 100]),
    (9, 3, 64, [3, 130, 64, 1, 65]),
    (9, 3, 16, [40, 2, 16]),
]
CASE_IDS = [f"h{h}kv{kv}-bs{bs}-L{max(lens)}" for h, kv, bs, lens in CASES]


# --- the reference: softmax(Q K^T / sqrt(d)) V in fp64, explicit bottom-right mask, GQA by repeat ----


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (Lq, H, D), k/v (Lk, Hkv, D) of ONE sequence -> (Lq, H, D) fp64; query i sits at position Lk - Lq + i."""
    Lq, H, _ = q.shape
    Lk, Hkv, _ = k.shape
    k = k.double().repeat_interleave(H // Hkv, dim=1)  # (Lk, H, D): q head h reads kv head h // group
    v = v.double().repeat_interleave(H // Hkv, dim=1)
    out = []
    for start in range(0, Lq, 256):  # query chunks keep the (H, 256, Lk) scores small
        qc = q[start : start + 256].double()  # (c, H, D)
        pos = torch.arange(start, start + qc.shape[0])[:, None] + (Lk - Lq)  # (c, 1) absolute query positions
        seen = int(pos[-1]) + 1  # keys after the chunk's last query: all masked
        scores = torch.einsum("qhd,khd->hqk", qc, k[:seen]) * scale  # (H, c, seen)
        allowed = torch.arange(seen)[None, :] <= pos  # (c, seen) bottom-right causal
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[:seen]))
    return torch.cat(out)


# --- helpers: ragged batches and a paged cache ---------------------------------------------------------


def dtype_for(backend: str) -> torch.dtype:
    return torch.float32 if backend == "torch" else torch.bfloat16


def need(backend: str, block_size: int | None = None) -> None:
    if backend not in attention_backends.available(DEVICE):
        pytest.skip(f"backend {backend!r} not available on {DEVICE}")
    if backend == "flash_attn" and block_size is not None and block_size % 256:
        pytest.skip("flash-attn's paged KV needs block_size % 256 == 0")


BACKENDS = ["torch", pytest.param("fa4", marks=pytest.mark.gpu), pytest.param("flash_attn", marks=pytest.mark.gpu)]


def ragged(lens: list[int], heads: int, kv_heads: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, heads, HEAD_DIM, generator=g).to(DEVICE, dtype)  # (T, H, D)
    k = torch.randn(T, kv_heads, HEAD_DIM, generator=g).to(DEVICE, dtype)  # (T, Hkv, D)
    v = torch.randn(T, kv_heads, HEAD_DIM, generator=g).to(DEVICE, dtype)
    cu = torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)  # (S + 1,)
    return q, k, v, cu


def paged_layout(lens: list[int], block_size: int, shuffle: bool, spare: int = 3, seed: int = 0):
    """Block tables (S, max_blocks) int32 padded with -1, and each token's slot; `shuffle` scatters the blocks."""
    needed = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(needed) + spare
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g) if shuffle else torch.arange(num_blocks)
    tables = torch.full((len(lens), max(needed) + 1), -1, dtype=torch.int32)  # one extra -1 column of padding
    slots, used = [], 0
    for i, (n, nb) in enumerate(zip(lens, needed)):
        tables[i, :nb] = order[used : used + nb]
        used += nb
        pos = torch.arange(n)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    return num_blocks, tables.to(DEVICE), torch.cat(slots).to(DEVICE)


def make_cache(num_blocks, block_size, kv_heads, dtype, k, v, slots, seed=1):
    """Random (finite) cache, so reading a slot that is not in the context would change the result."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(shape, generator=g).to(DEVICE, dtype)
    k_cache.view(-1, kv_heads, HEAD_DIM)[slots] = k
    v_cache.view(-1, kv_heads, HEAD_DIM)[slots] = v
    return k_cache, v_cache


def split(x: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    return list(x.split(lens))


# --- prefill over fresh K/V -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads,kv_heads,block_size,lens", CASES, ids=CASE_IDS)
def test_prefill_matches_reference(backend, heads, kv_heads, block_size, lens):
    need(backend)
    q, k, v, cu = ragged(lens, heads, kv_heads, dtype_for(backend))
    scale = HEAD_DIM**-0.5
    out = attention_backends.create(backend).prefill(q, k, v, cu, max(lens), scale)
    assert out.shape == q.shape
    expected = torch.cat([naive_attention(*t, scale) for t in zip(split(q, lens), split(k, lens), split(v, lens))])
    assert_close(out.float(), expected, dtype=q.dtype)


# --- decode over the paged cache ----------------------------------------------------------------------


def page_table(backend: str, tables: torch.Tensor) -> torch.Tensor:
    """What the Attention layer passes: -1 padded tables for torch, padding mapped to block 0 for flash kernels."""
    return tables if backend == "torch" else tables.clamp(min=0)


def decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """One query per sequence (q row i) over that sequence's packed k/v, by the fp64 reference."""
    return torch.cat(
        [naive_attention(q[i : i + 1], ki, vi, scale) for i, (ki, vi) in enumerate(zip(split(k, lens), split(v, lens)))]
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads,kv_heads,block_size,lens", CASES, ids=CASE_IDS)
def test_decode_matches_reference_and_contiguous_cache(backend, heads, kv_heads, block_size, lens):
    need(backend, block_size)
    dtype = dtype_for(backend)
    _, k, v, _ = ragged(lens, heads, kv_heads, dtype)
    q = torch.randn(len(lens), heads, HEAD_DIM, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM**-0.5
    outs = []
    for shuffle in (True, False):  # scattered blocks vs each sequence in consecutive blocks
        num_blocks, tables, slots = paged_layout(lens, block_size, shuffle)
        k_cache, v_cache = make_cache(num_blocks, block_size, kv_heads, dtype, k, v, slots)
        for i, (ki, n) in enumerate(zip(split(k, lens), lens)):
            assert torch.equal(gather_paged(k_cache, tables[i], n), ki)  # the table finds exactly our K
        outs.append(
            attention_backends.create(backend).decode(q, k_cache, v_cache, ctx, page_table(backend, tables), scale)
        )
    expected = decode_reference(q, k, v, lens, scale)
    assert_close(outs[0].float(), expected, dtype=dtype)
    assert_close(outs[0].float(), outs[1].float(), dtype=dtype)  # paged == contiguous


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_padded_rows(backend):
    """A CUDA-graph-padded batch: rows with context 0 and all -1 tables must not disturb the real rows."""
    need(backend, 256)
    heads, kv_heads, block_size, lens = 4, 2, 256, [300, 5]
    dtype = dtype_for(backend)
    _, k, v, _ = ragged(lens, heads, kv_heads, dtype)
    num_blocks, tables, slots = paged_layout(lens, block_size, shuffle=True)
    k_cache, v_cache = make_cache(num_blocks, block_size, kv_heads, dtype, k, v, slots)
    pad = 3
    tables = torch.cat([tables, torch.full((pad, tables.shape[1]), -1, dtype=torch.int32, device=DEVICE)])
    ctx = torch.tensor(lens + [0] * pad, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens) + pad, heads, HEAD_DIM, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    out = attention_backends.create(backend).decode(
        q, k_cache, v_cache, ctx, page_table(backend, tables), HEAD_DIM**-0.5
    )
    real = out[: len(lens)].float()
    assert torch.isfinite(real).all()
    expected = decode_reference(q, k, v, lens, HEAD_DIM**-0.5)
    assert_close(real, expected, dtype=dtype)


# --- our Triton decode kernel (minivllm/kernels/triton/paged_decode.py), the flash backends' decode on a GPU ---------

TRITON_CASES = CASES if DEVICE == "cuda" else CASES[1:]  # the interpreter is slow: no 2000-token context on CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads_fastest", [False, True], ids=["batch-fastest", "heads-fastest"])
@pytest.mark.parametrize("heads,kv_heads,block_size,lens", TRITON_CASES, ids=CASE_IDS[-len(TRITON_CASES) :])
def test_triton_decode_matches_reference(dtype, splits, heads_fastest, heads, kv_heads, block_size, lens):
    """GQA groups, tiles that cross pages (block size 16 < the kernel's 64-token tile), split-KV with splits
    longer than some contexts (empty splits), a padded row with context 0 (zeros, and no harm to the others),
    in either order of the programs."""
    from minivllm.kernels.triton.paged_decode import paged_decode

    _, k, v, _ = ragged(lens, heads, kv_heads, dtype)
    num_blocks, tables, slots = paged_layout(lens, block_size, shuffle=True)
    k_cache, v_cache = make_cache(num_blocks, block_size, kv_heads, dtype, k, v, slots)
    tables = torch.cat([tables, torch.full_like(tables[:1], -1)])  # + a padding row
    ctx = torch.tensor(lens + [0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens) + 1, heads, HEAD_DIM, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    scale = HEAD_DIM**-0.5
    out = paged_decode(q, k_cache, v_cache, ctx, tables.clamp(min=0), scale, splits=splits, heads_fastest=heads_fastest)
    assert_close(out[:-1].float(), decode_reference(q[:-1], k, v, lens, HEAD_DIM**-0.5), dtype=dtype)
    assert (out[-1] == 0).all()


def test_num_splits_rule():
    """The decode split count stays within what the combine kernel holds, never rises as the batch grows (a larger
    batch has more programs of its own), and leaves the batches that fill the GPU unsplit."""
    from minivllm.engine.cuda_graphs import graph_batch_sizes
    from minivllm.kernels.triton.paged_decode import MAX_SPLITS, num_splits

    for kv_heads in (2, 4, 8):
        counts = [num_splits(bs, kv_heads) for bs in graph_batch_sizes(512)]
        assert all(1 <= c <= MAX_SPLITS for c in counts)
        assert counts == sorted(counts, reverse=True), (kv_heads, counts)
        assert counts[0] == MAX_SPLITS and counts[-1] == 1


@pytest.mark.gpu
def test_gpu_decode_kernels_agree_on_the_benchmark_shapes():
    """Our Triton decode and FlashAttention-4's own, on Qwen3-0.6B's heads at the batch sizes bench.py meets."""
    from helpers.gpu import skip_without_fa4
    from minivllm.kernels.triton.paged_decode import paged_decode

    skip_without_fa4()
    g = torch.Generator().manual_seed(0)
    for batch, ctx in ((1, 2000), (16, 1500), (256, 600)):
        lens = torch.randint(ctx // 2, ctx + 1, (batch,), generator=g).tolist()
        num_blocks, tables, _ = paged_layout(lens, 256, shuffle=True)
        k_cache = torch.randn(num_blocks, 256, 8, 128, generator=g).to("cuda", torch.bfloat16)
        v_cache = torch.randn(num_blocks, 256, 8, 128, generator=g).to("cuda", torch.bfloat16)
        q = torch.randn(batch, 16, 128, generator=g).to("cuda", torch.bfloat16)
        ctx_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
        outs = dict(
            triton=paged_decode(q, k_cache, v_cache, ctx_t, tables.clamp(min=0), 128**-0.5),
            flash=attention_backends.create("fa4").decode(q, k_cache, v_cache, ctx_t, tables.clamp(min=0), 128**-0.5),
        )
        exact = attention_backends.create("torch").decode(
            q.float(), k_cache.float(), v_cache.float(), ctx_t, tables, 128**-0.5
        )
        err_t, err_f = (outs["triton"].float() - exact).abs().max(), (outs["flash"].float() - exact).abs().max()
        assert err_t <= 2 * err_f + 1e-3, f"batch {batch}: triton error {err_t:.3g}, FA4 error {err_f:.3g}"


def prefill_paged(backend, q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, ctx, tables, scale):
    return attention_backends.create(backend).prefill_paged(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        context_lens=ctx,
        block_tables=tables,
        scale=scale,
    )


# --- prefill over the paged cache: a cached prefix (or an earlier chunk) ---------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads,kv_heads,block_size,lens", CASES, ids=CASE_IDS)
def test_prefix_prefill_matches_full_recompute(backend, heads, kv_heads, block_size, lens):
    need(backend, block_size)
    dtype = dtype_for(backend)
    q, k, v, cu = ragged(lens, heads, kv_heads, dtype)
    scale = HEAD_DIM**-0.5
    g = torch.Generator().manual_seed(7)
    new = [int(torch.randint(1, n + 1, (1,), generator=g)) for n in lens]  # 1..n new queries, rest cached
    num_blocks, tables, slots = paged_layout(lens, block_size, shuffle=True)
    k_cache, v_cache = make_cache(num_blocks, block_size, kv_heads, dtype, k, v, slots)
    q_new = torch.cat([qi[n - m :] for qi, n, m in zip(split(q, lens), lens, new)])  # (sum(new), H, D)
    cu_q = torch.tensor([0] + new, device=DEVICE).cumsum(0).to(torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = prefill_paged(
        backend, q_new, k_cache, v_cache, cu_q, cu, max(new), max(lens), ctx, page_table(backend, tables), scale
    )
    full = attention_backends.create(backend).prefill(q, k, v, cu, max(lens), scale)  # recompute everything
    full_rows = torch.cat([fi[n - m :] for fi, n, m in zip(split(full, lens), lens, new)])
    assert_close(out.float(), full_rows.float(), dtype=dtype)
    expected = torch.cat(
        [
            naive_attention(qi[n - m :], ki, vi, scale)
            for qi, ki, vi, n, m in zip(split(q, lens), split(k, lens), split(v, lens), lens, new)
        ]
    )
    assert_close(out.float(), expected, dtype=dtype)


# --- the Attention layer: store, then one of three paths, driven by the step context ----------------------


@pytest.fixture
def layer_backend():
    yield
    reset_context()


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_layer_three_paths(backend, layer_backend):
    need(backend, 256 if backend == "flash_attn" else 16)
    heads, kv_heads, dtype = 4, 2, dtype_for(backend)
    block_size = 256 if backend == "flash_attn" else 16
    scale = HEAD_DIM**-0.5
    layer = Attention(heads, HEAD_DIM, scale, kv_heads, backend=attention_backends.create(backend))
    num_blocks = 8
    layer.k_cache = torch.zeros(num_blocks, block_size, kv_heads, HEAD_DIM, dtype=dtype, device=DEVICE)
    layer.v_cache = torch.zeros_like(layer.k_cache)
    # two sequences; sequence 0 owns blocks [5, 2, ...], sequence 1 owns [0, 6, ...]
    full_lens = [2 * block_size + 3, block_size - 1]
    q, k, v, _ = ragged([n + 1 for n in full_lens], heads, kv_heads, dtype, seed=3)  # +1: the decode token
    qs, ks, vs = (
        split(q, [n + 1 for n in full_lens]),
        split(k, [n + 1 for n in full_lens]),
        split(v, [n + 1 for n in full_lens]),
    )
    tables = torch.tensor([[5, 2, 7], [0, 6, -1]], dtype=torch.int32, device=DEVICE)

    def slots_of(i, positions):
        pos = torch.as_tensor(positions, device=DEVICE)
        return (tables[i, pos // block_size].long() * block_size + pos % block_size).to(torch.int32)

    # 1) prefill over fresh K/V (no block tables): all but the last token of each sequence
    lens = full_lens
    cu = torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)
    slot_mapping = torch.cat([slots_of(i, range(n)) for i, n in enumerate(lens)])
    set_context(
        True,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max(lens),
        max_seqlen_k=max(lens),
        slot_mapping=slot_mapping,
    )
    out = layer(
        torch.cat([x[:n] for x, n in zip(qs, lens)]),
        torch.cat([x[:n] for x, n in zip(ks, lens)]),
        torch.cat([x[:n] for x, n in zip(vs, lens)]),
    )
    expected = torch.cat([naive_attention(qi[:n], ki[:n], vi[:n], scale) for qi, ki, vi, n in zip(qs, ks, vs, lens)])
    assert_close(out.float(), expected, dtype=dtype)
    for i, n in enumerate(lens):  # the store wrote every slot
        assert torch.equal(gather_paged(layer.k_cache, tables[i], n), ks[i][:n])
        assert torch.equal(gather_paged(layer.v_cache, tables[i], n), vs[i][:n])

    # 2) decode one token per sequence, batch padded with two rows (slot -1, context 0, table all -1)
    pad = 2
    dec_tables = torch.cat([tables, torch.full((pad, 3), -1, dtype=torch.int32, device=DEVICE)])
    dec_slots = torch.cat(
        [slots_of(0, [lens[0]]), slots_of(1, [lens[1]]), torch.full((pad,), -1, dtype=torch.int32, device=DEVICE)]
    )
    ctx = torch.tensor([n + 1 for n in lens] + [0] * pad, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(9)
    q_pad, kv_pad = (torch.randn(pad, h, HEAD_DIM, generator=g).to(DEVICE, dtype) for h in (heads, kv_heads))
    cache_before = layer.k_cache.clone()
    set_context(False, slot_mapping=dec_slots, context_lens=ctx, block_tables=dec_tables)
    out = layer(
        torch.cat([qs[0][-1:], qs[1][-1:], q_pad]),
        torch.cat([ks[0][-1:], ks[1][-1:], kv_pad]),
        torch.cat([vs[0][-1:], vs[1][-1:], kv_pad]),
    )
    expected = torch.cat([naive_attention(qi[-1:], ki, vi, scale) for qi, ki, vi in zip(qs, ks, vs)])
    assert torch.isfinite(out[:2].float()).all()
    assert_close(out[:2].float(), expected, dtype=dtype)
    changed = (layer.k_cache != cache_before).flatten(2).any(-1).flatten().nonzero().flatten()
    assert sorted(changed.tolist()) == sorted(dec_slots[:2].tolist())  # padding wrote nothing

    # 3) prefix hit: a third request shares sequence 0's first (full) block and adds 5 tokens of its own
    n_new = 5
    g = torch.Generator().manual_seed(11)
    q3, k3, v3 = (torch.randn(n_new, h, HEAD_DIM, generator=g).to(DEVICE, dtype) for h in (heads, kv_heads, kv_heads))
    table3 = torch.tensor([[5, 4]], dtype=torch.int32, device=DEVICE)  # block 5 shared, block 4 its own
    slots3 = (4 * block_size + torch.arange(n_new, device=DEVICE)).to(torch.int32)
    total = block_size + n_new
    set_context(
        True,
        cu_seqlens_q=torch.tensor([0, n_new], dtype=torch.int32, device=DEVICE),
        cu_seqlens_k=torch.tensor([0, total], dtype=torch.int32, device=DEVICE),
        max_seqlen_q=n_new,
        max_seqlen_k=total,
        slot_mapping=slots3,
        context_lens=torch.tensor([total], dtype=torch.int32, device=DEVICE),
        block_tables=table3,
    )
    out = layer(q3, k3, v3)
    k_full = torch.cat([ks[0][:block_size], k3])  # (total, Hkv, D)
    v_full = torch.cat([vs[0][:block_size], v3])
    assert_close(out.float(), naive_attention(q3, k_full, v_full, scale), dtype=dtype)
    # ... and equals the fresh-prefill path run over the whole sequence (queries for the prefix made up)
    q_full = torch.cat([torch.randn(block_size, heads, HEAD_DIM, generator=g).to(DEVICE, dtype), q3])
    recompute = attention_backends.create(backend).prefill(
        q_full, k_full, v_full, torch.tensor([0, total], dtype=torch.int32, device=DEVICE), total, scale
    )
    assert_close(out.float(), recompute[block_size:].float(), dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_decode_rows", [0, 3], ids=["prefill-kernel-for-all", "decode-rows-first"])
def test_prefill_step_whose_first_rows_decode(backend, num_decode_rows, layer_backend):
    """A prefill step of the engine's shape: three sequences decoding one token each first (one query, many
    cached keys), then two prompts in chunks (a later chunk, and one whose last chunk is a single token).
    With num_decode_rows the first three run the decode kernel and the others the prefill kernel; either
    way every row equals the reference over its whole context."""
    block_size = 256 if backend == "flash_attn" else 16
    need(backend, block_size)
    heads, kv_heads, dtype, scale = 4, 2, dtype_for(backend), HEAD_DIM**-0.5
    lens = [37, 5, 50, 40, 21]  # keys per sequence after this step
    new = [1, 1, 1, 7, 1]  # queries per sequence in this step
    q, k, v, _ = ragged(lens, heads, kv_heads, dtype, seed=5)
    num_blocks, tables, slots = paged_layout(lens, block_size, shuffle=True)
    layer = Attention(heads, HEAD_DIM, scale, kv_heads, backend=attention_backends.create(backend))
    ends = torch.tensor(lens).cumsum(0)
    new_rows = torch.cat([torch.arange(e - n, e) for e, n in zip(ends.tolist(), new)]).to(DEVICE)  # this step's
    cached = torch.ones(sum(lens), dtype=torch.bool, device=DEVICE)
    cached[new_rows] = False
    layer.k_cache, layer.v_cache = make_cache(
        num_blocks, block_size, kv_heads, dtype, k[cached], v[cached], slots[cached]
    )
    cu_q = torch.tensor([0] + new, device=DEVICE).cumsum(0).to(torch.int32)
    set_context(
        True,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=ends.new_tensor([0] + ends.tolist()).to(DEVICE, torch.int32),
        max_seqlen_q=max(new),
        max_seqlen_k=max(lens),
        slot_mapping=slots[new_rows].to(torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables,
        num_decode_rows=num_decode_rows,
    )
    try:
        out = layer(q[new_rows], k[new_rows], v[new_rows])
    finally:
        reset_context()
    qs, ks, vs = split(q, lens), split(k, lens), split(v, lens)
    expected = torch.cat([naive_attention(qi[-n:], ki, vi, scale) for qi, ki, vi, n in zip(qs, ks, vs, new)])
    assert out.shape == (sum(new), heads, HEAD_DIM)
    assert_close(out.float(), expected, dtype=dtype)


# --- bad input: clear ValueErrors -------------------------------------------------------------------------


def _paged_inputs(num_blocks=4, block_size=16):
    k_cache = torch.zeros(num_blocks, block_size, 2, 8)
    return k_cache, k_cache.clone()


def test_bad_input_raises_clear_errors():
    scale = 8**-0.5
    q, k = torch.randn(10, 4, 8), torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q/k/v token counts 10/9/9 != cu_seqlens\[-1\] = 10"):
        attention_backends.create("torch").prefill(q, k[:9], k[:9], cu, 6, scale)
    with pytest.raises(ValueError, match="multiple of its 3 kv heads"):
        attention_backends.create("torch").prefill(q, torch.randn(10, 3, 8), torch.randn(10, 3, 8), cu, 6, scale)
    with pytest.raises(ValueError, match="head_dim of k"):
        attention_backends.create("torch").prefill(q, torch.randn(10, 2, 4), torch.randn(10, 2, 4), cu, 6, scale)
    with pytest.raises(ValueError, match="must have the same shape"):
        attention_backends.create("torch").prefill(q, k, torch.randn(10, 1, 8), cu, 6, scale)

    k_cache, v_cache = _paged_inputs()
    qd = torch.randn(2, 4, 8)
    ok_ctx, ok_tables = torch.tensor([5, 20], dtype=torch.int32), torch.tensor([[0, -1], [1, 2]], dtype=torch.int32)
    assert attention_backends.create("torch").decode(qd, k_cache, v_cache, ok_ctx, ok_tables, scale).shape == (2, 4, 8)
    with pytest.raises(ValueError, match=r"block table points outside the cache: blocks 0\.\.7, cache has 4"):
        attention_backends.create("torch").decode(
            qd, k_cache, v_cache, ok_ctx, torch.tensor([[0, -1], [1, 7]], dtype=torch.int32), scale
        )
    with pytest.raises(
        ValueError, match=r"a context of 40 tokens is longer than the block table covers \(2 blocks x 16\)"
    ):
        attention_backends.create("torch").decode(
            qd, k_cache, v_cache, torch.tensor([5, 40], dtype=torch.int32), ok_tables, scale
        )
    with pytest.raises(ValueError, match="3 queries but 2 context lengths"):
        attention_backends.create("torch").decode(torch.randn(3, 4, 8), k_cache, v_cache, ok_ctx, ok_tables, scale)
    with pytest.raises(ValueError, match=r"block_tables \(1, 2\) must be \(num_seqs=2, max_blocks\)"):
        attention_backends.create("torch").decode(qd, k_cache, v_cache, ok_ctx, ok_tables[:1], scale)
    with pytest.raises(ValueError, match="must both be"):
        attention_backends.create("torch").decode(qd, k_cache, v_cache[:, :8], ok_ctx, ok_tables, scale)
    with pytest.raises(ValueError, match="kv heads"):
        attention_backends.create("torch").decode(torch.randn(2, 3, 8), k_cache, v_cache, ok_ctx, ok_tables, scale)

    cu_q, cu_k = torch.tensor([0, 3, 6], dtype=torch.int32), torch.tensor([0, 5, 25], dtype=torch.int32)
    qp = torch.randn(6, 4, 8)
    assert prefill_paged("torch", qp, k_cache, v_cache, cu_q, cu_k, 3, 20, ok_ctx, ok_tables, scale).shape == (6, 4, 8)
    with pytest.raises(ValueError, match="cu_seqlens_q"):  # 7 query tokens, cu_q ends at 6
        prefill_paged("torch", torch.randn(7, 4, 8), k_cache, v_cache, cu_q, cu_k, 3, 20, ok_ctx, ok_tables, scale)
    with pytest.raises(ValueError, match="cu_seqlens_q"):  # 2 sequences in cu_q, 1 context length
        prefill_paged("torch", qp, k_cache, v_cache, cu_q, cu_k, 3, 20, ok_ctx[:1], ok_tables[:1], scale)
    with pytest.raises(ValueError, match="sequence 0: 3 queries but only 2 keys in its context"):
        prefill_paged(
            "torch", qp, k_cache, v_cache, cu_q, cu_k, 3, 20, torch.tensor([2, 20], dtype=torch.int32), ok_tables, scale
        )
    with pytest.raises(ValueError, match="block table points outside the cache"):
        prefill_paged(
            "torch",
            qp,
            k_cache,
            v_cache,
            cu_q,
            cu_k,
            3,
            20,
            ok_ctx,
            torch.tensor([[-1, 0], [1, 2]], dtype=torch.int32),
            scale,
        )
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_backends.select("cpu", torch.float32, "xformers")
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        attention_backends.create("xformers")


def test_a_backend_shares_one_steps_metadata_between_its_layers():
    """The padding-free tables and the prefill rows after the decode rows are made once per step by the backend
    (the step's first layer) and reused by the others; a new step (a new context) makes them again."""
    backend = attention_backends.create("fa4")  # a table only: nothing runs
    tables = torch.tensor([[3, -1], [1, 2], [0, -1]], dtype=torch.int32)
    step = Context(
        is_prefill=True,
        cu_seqlens_q=torch.tensor([0, 1, 4, 6], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 9, 20, 26], dtype=torch.int32),
        context_lens=torch.tensor([9, 11, 6], dtype=torch.int32),
        block_tables=tables,
        num_decode_rows=1,
    )
    page_table, rows = backend.tables(step), backend.prefill_rows(step)
    assert page_table.tolist() == [[3, 0], [1, 2], [0, 0]] and backend.tables(step) is page_table
    assert backend.prefill_rows(step) is rows
    assert rows.cu_seqlens_q.tolist() == [0, 3, 5] and rows.cu_seqlens_k.tolist() == [0, 11, 17]
    assert rows.block_tables.tolist() == [[1, 2], [0, 0]] and rows.context_lens.tolist() == [11, 6]
    later = Context(is_prefill=False, context_lens=step.context_lens, block_tables=tables.flip(0))
    assert backend.tables(later).tolist() == [[0, 0], [1, 2], [3, 0]]
    assert attention_backends.create("torch").tables(step) is tables  # torch reads the -1 padding itself
