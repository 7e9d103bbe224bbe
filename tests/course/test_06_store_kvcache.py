"""Chapter 06: store_kvcache_kernel and its launch store_kvcache (minivllm/kernels/triton/store_kvcache.py,
natively on a GPU, through Triton's interpreter on a CPU), and store_kvcache_torch (minivllm/layers/attention.py),
fp32 and bf16; and why the engine's GPU path is the kernel: the masked index assignment asks the host for a count."""

import pytest
import torch

from helpers.course import DTYPES, KERNEL_DEVICE, HostSyncs, odd_size, seeded
from minivllm.kernels.triton.store_kvcache import store_kvcache
from minivllm.layers.attention import store_kvcache_torch

IDS = ["fp32", "bf16"]
STORES = {"store_kvcache": store_kvcache, "store_kvcache_torch": store_kvcache_torch}


def case(dtype, seed: int, device: str = "cpu"):
    """K/V of N tokens as strided slices of a fused qkv (as the model hands them), a cache, slots with padding."""
    gen = seeded(seed)
    heads_kv, head_dim, block_size = 3, odd_size(gen, 5, 14), 7
    num_blocks, n = 6, odd_size(gen, 5, 20)
    qkv = torch.randn(n, 4 * heads_kv * head_dim, generator=gen).to(device, dtype)
    k = qkv[:, 2 * heads_kv * head_dim : 3 * heads_kv * head_dim].view(n, heads_kv, head_dim)
    v = qkv[:, 3 * heads_kv * head_dim :].view(n, heads_kv, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n].to(torch.int32)
    slots[torch.rand(n, generator=gen) < 0.25] = -1  # padding rows: write nothing
    shape = (num_blocks, block_size, heads_kv, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))
    return k, v, k_cache, v_cache, slots.to(device)


def expected(cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    out = cache.clone().flatten(0, 1)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[slot] = new[i]
    return out.view_as(cache)


@pytest.mark.parametrize("name", list(STORES))
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_store(name, dtype):
    k, v, k_cache, v_cache, slots = case(dtype, 30, KERNEL_DEVICE if name == "store_kvcache" else "cpu")
    want_k, want_v = expected(k_cache, k, slots), expected(v_cache, v, slots)
    exercise = "store_kvcache_kernel (launched by store_kvcache)" if name == "store_kvcache" else name
    STORES[name](k, v, k_cache, v_cache, slots)
    bs = k_cache.shape[1]
    for what, got, want in (("k_cache", k_cache, want_k), ("v_cache", v_cache, want_v)):
        slot_diff = (got != want).flatten(2).any(-1).flatten()  # (num_blocks * block_size,) slot differs
        if slot_diff.any():
            slot = int(slot_diff.nonzero()[0])
            rows = (slots == slot).nonzero().flatten().tolist()
            raise AssertionError(
                f"{exercise}: {what}: {int(slot_diff.sum())} slots differ; first slot {slot} (block {slot // bs}, "
                f"offset {slot % bs}): "
                + (
                    f"token {rows[0]} should be written there"
                    if rows
                    else "no token maps there (slot -1 is padding: write nothing), it changed"
                )
            )


def test_store_launch_checks_its_inputs():
    k, v, k_cache, v_cache, slots = case(torch.float32, 31, KERNEL_DEVICE)
    with pytest.raises(AssertionError, match="slot_mapping"):
        store_kvcache(k, v, k_cache, v_cache, slots[:-1])


def test_masked_assignment_needs_the_host():
    """A CUDA graph replays fixed launches: an op whose output size depends on data (a boolean mask's indexing)
    or that reads a value back must wait for the device, and graph capture refuses it. The kernel's launch has
    none: each program reads its slot and skips -1 itself."""
    k, v, k_cache, v_cache, slots = case(torch.float32, 32, KERNEL_DEVICE)
    with HostSyncs() as masked:
        store_kvcache_torch(k, v, k_cache, v_cache, slots)
    with HostSyncs() as kernel:
        store_kvcache(k, v, k_cache, v_cache, slots)
    assert masked.found, "store_kvcache_torch: expected the masked assignment (padding slots -1 skipped by a mask)"
    assert not kernel.found, f"store_kvcache: the launch must need no host sync, it ran {kernel.found}"
