"""KV-cache sizing (minivllm/engine/kv_cache.py): the bytes of one block, the CPU byte budget in whole blocks
and its cap, the GPU arithmetic on a GpuMemory made by hand, the ranks agreeing on the smallest count, and the
error when nothing is left for the cache. Then the engine: the cache it allocates, and the requests it
refuses, follow that count."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import Config
from minivllm.engine.kv_cache import GpuMemory, kv_block_bytes, num_kvcache_blocks

GIB = 1 << 30


def test_block_bytes(tiny_qwen3):
    # K and V x 2 layers x 16 tokens x 2 KV heads x head_dim 16
    c = Config(tiny_qwen3, kvcache_block_size=16)
    assert kv_block_bytes(c, torch.float32) == 2 * 2 * 16 * 2 * 16 * 4 == 8192
    assert kv_block_bytes(c, torch.bfloat16) == 4096
    c = Config(tiny_qwen3, kvcache_block_size=16, tensor_parallel_size=2)
    assert kv_block_bytes(c, torch.float32) == 4096  # a rank holds half the KV heads


def test_cpu_budget_in_whole_blocks_capped_at_what_can_be_filled(tiny_qwen3):
    c = Config(tiny_qwen3, kvcache_block_size=16, max_num_seqs=4, max_model_len=100, cpu_kvcache_bytes=11 * 8192 - 1)
    assert num_kvcache_blocks(c, 8192) == 10  # whole blocks only
    c.cpu_kvcache_bytes = GIB
    assert num_kvcache_blocks(c, 8192) == 4 * 7  # 4 sequences of 100 tokens fill 7 blocks each, no more
    c.num_kvcache_blocks = 3
    assert num_kvcache_blocks(c, 8192) == 3  # set by hand: exactly that


def test_gpu_blocks_are_what_is_left_under_the_utilisation(tiny_qwen3):
    c = Config(tiny_qwen3, gpu_memory_utilization=0.9)
    # an 80 GiB card: another process holds 6 GiB, ours holds 10 GiB (the weights) and peaked at 14 GiB
    gpu = GpuMemory(total=80 * GIB, free=64 * GIB, peak=14 * GIB, current=10 * GIB)
    # 0.9 x 80 = 72 GiB for us, less the other process's 6 and our peak 14: 52 GiB of 256 MiB blocks
    assert num_kvcache_blocks(c, GIB // 4, gpu) == 52 * 4
    assert num_kvcache_blocks(c, 3 * GIB, gpu) == 17  # whole blocks: 52 // 3
    c.gpu_memory_utilization = 0.5  # 40 - 6 - 14 = 20 GiB
    assert num_kvcache_blocks(c, GIB, gpu) == 20
    c.num_kvcache_blocks = 5
    assert num_kvcache_blocks(c, GIB, gpu) == 5


def test_nothing_left_for_the_cache_is_a_clear_error(tiny_qwen3):
    c = Config(tiny_qwen3, gpu_memory_utilization=0.2)  # 16 GiB, but 6 + 14 are taken
    gpu = GpuMemory(total=80 * GIB, free=64 * GIB, peak=14 * GIB, current=10 * GIB)
    with pytest.raises(
        RuntimeError, match=r"no memory left .* gpu_memory_utilization=0.2 of the GPU is already in use"
    ):
        num_kvcache_blocks(c, GIB, gpu)
    c = Config(tiny_qwen3, cpu_kvcache_bytes=8191)
    with pytest.raises(RuntimeError, match=r"one block needs 8192 bytes\): .* too small \(cpu_kvcache_bytes=8191\)"):
        num_kvcache_blocks(c, 8192)
    with pytest.raises(RuntimeError, match=r"too small \(cpu_kvcache_bytes=8191\)"):
        LLM(tiny_qwen3, kvcache_block_size=16, cpu_kvcache_bytes=8191, device="cpu")


def test_the_ranks_agree_on_the_smallest_count(tiny_qwen3):
    c = Config(tiny_qwen3, cpu_kvcache_bytes=GIB)
    assert num_kvcache_blocks(c, 8192, agree=lambda n: min(n, 17)) == 17  # another rank has room for 17
    with pytest.raises(RuntimeError, match="no memory left"):
        num_kvcache_blocks(c, 8192, agree=lambda n: min(n, 0))  # checked after agreeing: one rank has none
    # ModelRunner.agree_min over two gloo ranks: tests/test_tp.py


def test_the_engine_allocates_and_refuses_by_the_count(tiny_qwen3):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, cpu_kvcache_bytes=5 * 8192 + 100, max_model_len=256, device="cpu")
    assert llm.config.num_kvcache_blocks == 5 and llm.model_runner.kv_cache.shape[2] == 5
    with pytest.raises(ValueError, match="needs 6 KV blocks; the cache has only 5"):
        llm.generate([[1] * 80], SamplingParams(max_tokens=10), use_tqdm=False)
    out = llm.generate([[1] * 70], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 10  # 80 tokens: 5 blocks, the whole cache
