"""store_kvcache (Triton; the interpreter on CPU) against plain torch index assignment, and the seed's
teaching kernel scatter_rows (seed 002 section 5.1, seed 000 section 7.1)."""

import pytest
import torch

import minivllm  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, before any kernel runs)
from helpers.scatter import scatter_rows
from minivllm.kernels.triton.store_kvcache import store_kvcache
from minivllm.layers.attention import store_kvcache_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_store(key, value, k_cache, v_cache, slots):
    """k_cache.view(-1, D)[slots] = key.view(N, D), skipping slot -1 (what the kernel must do)."""
    N, D = key.shape[0], key.shape[1] * key.shape[2]
    keep = slots >= 0
    k_cache.view(-1, D)[slots[keep].long()] = key.reshape(N, D)[keep]
    v_cache.view(-1, D)[slots[keep].long()] = value.reshape(N, D)[keep]


def make_case(N, kv_heads, head_dim, num_blocks, block_size, dtype, slot_dtype, num_skipped=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(N, kv_heads, head_dim, generator=g).to(DEVICE, dtype)  # (N, kv_heads, head_dim)
    value = torch.randn(N, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:N]  # distinct slots
    slots[torch.randperm(N, generator=g)[:num_skipped]] = -1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(DEVICE, dtype)  # non-zero: untouched rows are visible
    v_cache = torch.randn(shape, generator=g).to(DEVICE, dtype)
    return key, value, k_cache, v_cache, slots.to(DEVICE, slot_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_matches_index_assignment(dtype, slot_dtype):
    key, value, k_cache, v_cache, slots = make_case(
        12, 2, 8, num_blocks=4, block_size=8, dtype=dtype, slot_dtype=slot_dtype, num_skipped=3
    )
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference_store(key, value, k_ref, v_ref, slots)
    store_kvcache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # a copy: bit-exact


def test_minus_one_slots_leave_cache_untouched():
    key, value, k_cache, v_cache, slots = make_case(
        6, 2, 4, num_blocks=2, block_size=4, dtype=torch.float32, slot_dtype=torch.int32
    )
    before_k, before_v = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, torch.full_like(slots, -1))
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)
    slots[1:] = -1  # only token 0 is written
    store_kvcache(key, value, k_cache, v_cache, slots)
    changed = (k_cache != before_k).flatten(2).any(-1).flatten()  # (num_slots,)
    assert changed.nonzero().flatten().tolist() == [int(slots[0])]
    assert torch.equal(k_cache.view(-1, 8)[int(slots[0])], key[0].flatten())


def test_strided_slices_of_fused_qkv():
    """K and V as the model makes them: qkv.split(...) then view, so rows are strided (stride(0) = qkv width)."""
    N, heads, kv_heads, head_dim = 5, 4, 2, 8
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(N, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE)  # (N, q + k + v)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k = k.view(-1, kv_heads, head_dim)  # (N, kv_heads, head_dim)
    v = v.view(-1, kv_heads, head_dim)
    assert not k.is_contiguous() and k.stride(0) == qkv.shape[1]
    k_cache = torch.zeros(2, 4, kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([7, 0, 3, -1, 5], dtype=torch.int32, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference_store(k, v, k_ref, v_ref, slots)
    store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[7], k[0])  # slot 7 holds token 0's K


def test_torch_store_matches_kernel():
    """store_kvcache_torch (the Attention layer's CPU store) writes exactly what the kernel writes."""
    key, value, k_cache, v_cache, slots = make_case(
        10, 3, 8, num_blocks=3, block_size=8, dtype=torch.bfloat16, slot_dtype=torch.int32, num_skipped=4, seed=4
    )
    k2, v2 = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    store_kvcache_torch(key, value, k2, v2, slots)
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)


def test_row_width_not_a_power_of_two():
    """D = 3 kv heads x 64 = 192: the kernel loads next_power_of_2(D) = 256 lanes and masks the last 64."""
    key, value, k_cache, v_cache, slots = make_case(
        4, 3, 64, num_blocks=3, block_size=2, dtype=torch.float32, slot_dtype=torch.int64, num_skipped=1
    )
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference_store(key, value, k_ref, v_ref, slots)
    store_kvcache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # neighbours of each slot unharmed


def test_seed_four_token_example():
    """Seed 002 section 5.1: token t's numbers start with 10 t, value = key + 100, slots [2, 0, -1, 1]."""
    N, kv_heads, head_dim = 4, 2, 2
    base = torch.arange(kv_heads * head_dim).reshape(1, kv_heads, head_dim)  # [[0, 1], [2, 3]]
    key = (torch.arange(N).reshape(N, 1, 1) * 10 + base).float().to(DEVICE)  # (N, 2, 2)
    value = key + 100
    slots = torch.tensor([2, 0, -1, 1], dtype=torch.int32, device=DEVICE)
    k_cache = torch.zeros(1, 4, kv_heads, head_dim, device=DEVICE)  # 4 slots
    v_cache = torch.zeros_like(k_cache)
    store_kvcache(key, value, k_cache, v_cache, slots)
    assert k_cache.view(-1, 4).int().tolist() == [[10, 11, 12, 13], [30, 31, 32, 33], [0, 1, 2, 3], [0, 0, 0, 0]]
    assert v_cache.view(-1, 4)[0].int().tolist() == [110, 111, 112, 113]


def test_empty_batch_is_a_no_op():
    k_cache = torch.ones(1, 2, 1, 4, device=DEVICE)
    store_kvcache(
        torch.empty(0, 1, 4, device=DEVICE),
        torch.empty(0, 1, 4, device=DEVICE),
        k_cache,
        k_cache.clone(),
        torch.empty(0, dtype=torch.int32, device=DEVICE),
    )
    assert torch.equal(k_cache, torch.ones_like(k_cache))


def test_bad_layouts_are_refused():
    k_cache = torch.zeros(1, 4, 2, 8, device=DEVICE)
    slots = torch.arange(3, dtype=torch.int32, device=DEVICE)
    ok = torch.randn(3, 2, 8, device=DEVICE)
    with pytest.raises(AssertionError, match="head_dim must be contiguous"):
        t = torch.randn(3, 2, 16, device=DEVICE)[:, :, ::2]  # stride(-1) = 2
        store_kvcache(t, t, k_cache, k_cache.clone(), slots)
    with pytest.raises(AssertionError, match="heads of a token must be contiguous"):
        t = torch.randn(3, 2, 16, device=DEVICE)[:, :, :8]  # stride(1) = 16 != head_dim
        store_kvcache(t, t, k_cache, k_cache.clone(), slots)
    with pytest.raises(AssertionError, match="each cache slot must hold D contiguous values"):
        wide = torch.zeros(1, 4, 2, 16, device=DEVICE)[..., :8]  # slot stride 32 != D = 16
        store_kvcache(ok, ok, wide, wide.clone(), slots)
    with pytest.raises(AssertionError, match="slot_mapping has 2 entries for 3 tokens"):
        store_kvcache(ok, ok, k_cache, k_cache.clone(), slots[:2])
    with pytest.raises(AssertionError, match=r"cache \(kv_heads, head_dim\)"):
        store_kvcache(ok, ok, torch.zeros(1, 4, 1, 16, device=DEVICE), torch.zeros(1, 4, 1, 16, device=DEVICE), slots)


def test_scatter_rows_seed_example():
    """The teaching kernel: N=3, D=4, slot [2, 0, 1] -> dst row r holds src row slot^-1(r)."""
    src = torch.arange(12, dtype=torch.float32, device=DEVICE).reshape(3, 4)
    dst = scatter_rows(src, torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE))
    assert dst.int().tolist() == [[4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3]]
    g = torch.Generator().manual_seed(3)
    src = torch.randn(5, 8, generator=g).to(DEVICE)
    slot = torch.randperm(9, generator=g)[:5].to(DEVICE)
    expected = torch.zeros(9, 8, device=DEVICE)
    expected[slot] = src
    assert torch.equal(scatter_rows(src, slot, num_rows=9), expected)
