"""The CPU KV cache and the CPU decode path: the cache's memory (engine/kv_cache.py: its own zeroed mapping,
small pages) and the decode gather every layer of a step shares (kernels/torch_attention.py: built once per
step, rebuilt whenever its inputs' values change, even when they change in place)."""

import gc
import os

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.kv_cache import allocate_zeroed
from minivllm.kernels import torch_attention
from minivllm.kernels.torch_attention import DecodeGather, decode_gather, paged_decode_attention

CPU = torch.device("cpu")


# --- the cache's memory ---------------------------------------------------------------------------------


def vm_flags_of(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_cache_is_zeroed_writable_and_outlives_its_mapping_object(dtype):
    cache = allocate_zeroed((2, 3, 5, 16, 2, 8), dtype, CPU)  # (2, layers, blocks, block_size, kv_heads, head_dim)
    gc.collect()  # the tensor alone keeps the mapping alive
    assert cache.shape == (2, 3, 5, 16, 2, 8) and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.any()
    cache[1, 2, 4, 15] = 7.0  # the last row: the whole mapping is there and writable
    assert cache.sum().item() == 7.0 * 16


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux: reads /proc/self/smaps")
def test_cpu_cache_asks_for_small_pages():
    # numpy's calloc (the cache's memory before) madvises large blocks for huge pages ("hg"); the cache's own
    # mapping asks for none ("nh"), so a store's first touch zeroes 4 KiB, not 2 MiB
    cache = allocate_zeroed((2, 2, 64, 256, 2, 64), torch.float32, CPU)  # 32 MiB
    flags = vm_flags_of(cache.data_ptr() + cache.nbytes // 2)
    assert "nh" in flags and "hg" not in flags, flags


# --- the decode gather, shared by the layers of a step ----------------------------------------------------


def decode_inputs(lens: list[int], block_size: int = 4, num_blocks: int = 16, heads: int = 4, kv_heads: int = 2):
    """A cache filled at random and tables that give each sequence its own shuffled blocks."""
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, 8, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, 8, generator=g)
    width = max(-(-n // block_size) for n in lens)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)  # (B, M), -1 padded
    for i, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            tables[i, j] = order.pop()
    q = torch.randn(len(lens), heads, 8, generator=g)  # (B, H, D)
    return q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), tables


def reference_decode(q, k_cache, v_cache, lens, tables) -> torch.Tensor:
    """Softmax attention per sequence over its keys, read block by block: (B, H, D)."""
    out = []
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i, : -(-n // k_cache.shape[1])].long()
        k = k_cache[blocks].flatten(0, 1)[:n].double()  # (n, Hkv, D)
        v = v_cache[blocks].flatten(0, 1)[:n].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (n, H, D)
        w = (torch.einsum("hd,nhd->hn", q[i].double(), k) * q.shape[-1] ** -0.5).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", w, v))
    return torch.stack(out).float()


def test_gather_is_built_once_for_equal_inputs():
    q, k_cache, v_cache, lens, tables = decode_inputs([5, 9, 3])
    cache = {}  # a backend's
    first = decode_gather(q, k_cache, v_cache, lens, tables, cache)
    assert decode_gather(q, k_cache + 1, v_cache, lens, tables, cache) is first  # another layer's cache, same rows
    assert decode_gather(q, k_cache, v_cache, lens.clone(), tables.clone(), cache) is first  # equal values
    assert decode_gather(q, k_cache, v_cache, lens, tables) is not first  # no cache: built anew
    assert decode_gather(q, k_cache, v_cache, lens, tables, {}) is not first  # another backend's: its own
    assert isinstance(first, DecodeGather) and first.slots.shape == (3, 9) and first.mask.shape == (3, 1, 1, 9)


@pytest.mark.parametrize("inference", [False, True])
def test_gather_follows_inputs_changed_in_place(inference):
    # the engine hands every step new tensors, but a caller may rewrite the same ones; an inference tensor
    # has no version counter, so the gather must be keyed by values, not by identity
    with torch.inference_mode(inference):
        q, k_cache, v_cache, lens, tables = decode_inputs([5, 9, 3])
        scale, cache = 8**-0.5, {}
        torch.testing.assert_close(
            paged_decode_attention(q, k_cache, v_cache, lens, tables, scale, cache),
            reference_decode(q, k_cache, v_cache, lens, tables),
        )
        lens[1] = 6  # same tensor, shorter context
        tables[0, 1] = tables[1, 2]  # and sequence 0 reads another block
        torch.testing.assert_close(
            paged_decode_attention(q, k_cache, v_cache, lens, tables, scale, cache),
            reference_decode(q, k_cache, v_cache, lens, tables),
        )


def test_gather_still_checks_each_call():
    q, k_cache, v_cache, lens, tables = decode_inputs([5, 9, 3])
    cache = {}
    decode_gather(q, k_cache, v_cache, lens, tables, cache)
    with pytest.raises(ValueError, match="2 queries but 3 context lengths"):
        decode_gather(q[:2], k_cache, v_cache, lens, tables, cache)  # same lens and tables: the gather is there
    with pytest.raises(ValueError, match="head_dim of k"):
        decode_gather(q[..., :4], k_cache, v_cache, lens, tables, cache)
    small = int(tables.max())  # a cache whose last block the tables use is not there
    with pytest.raises(ValueError, match=f"block table points outside the cache: .* cache has {small}"):
        decode_gather(q, k_cache[:small], v_cache[:small], lens, tables, cache)


def test_engine_builds_one_gather_per_decode_step(tiny_qwen3, monkeypatch):
    """Two layers, one build per decode step; and the tokens are those of an engine that builds per layer (the
    torch path: the C++ decode reads the paged cache in place and gathers nothing)."""
    builds = []
    check_tables = torch_attention.check_tables
    monkeypatch.setattr(torch_attention, "check_tables", lambda *a: builds.append(1) or check_tables(*a))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(tiny_qwen3, kvcache_block_size=16, device="cpu", kernels=dict(cpu_ops=False))
    assert llm.config.hf_config.num_hidden_layers == 2
    shared = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert len(builds) == 6 - 1  # one prefill (its keys are fresh: no gather), then 5 decode steps
    monkeypatch.setattr(DecodeGather, "fits", lambda *a: False)  # every layer builds its own
    builds.clear()
    per_layer = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.exit()
    assert len(builds) == 2 * (6 - 1)
    assert shared == per_layer and all(len(t) == 6 for t in shared)
