"""How many KV-cache blocks an engine gets (nano-vllm's allocate_kv_cache arithmetic, as one function).

One block holds K and V of `block_size` tokens for every layer: 2 x layers x block_size x kv_heads x
head_dim values. On a GPU the cache takes what is left of `gpu_memory_utilization` of the card after the
weights and the peak activations of the warm-up (the largest prefill); on CPU it gets a fixed byte budget
(`Config.cpu_kvcache_bytes`), capped at what the engine could ever fill."""

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.config import Config


def kv_cache_shape(config: Config, num_blocks: int) -> tuple[int, ...]:
    """(2, layers, num_blocks, block_size, kv_heads, head_dim) on one tensor-parallel rank: K and V of every
    layer, each rank holding its share of the KV heads. A layer's K cache is `cache[0, layer]`."""
    hf = config.hf_config
    num_kv_heads = hf.num_key_value_heads // config.tensor_parallel_size
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return (2, hf.num_hidden_layers, num_blocks, config.kvcache_block_size, num_kv_heads, head_dim)


def allocate_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache (unused rows must be finite: attention multiplies them by zero weights). On CPU it
    is an anonymous mapping of its own: the OS hands out zero pages as they are first touched, so a 1 GiB
    budget costs nothing until used (torch.zeros would write every byte up front: ~0.5 s per GiB), and the
    mapping asks for small pages. A decode step writes one row (Hkv x D values) per sequence and layer; with
    transparent huge pages the first row written in a 2 MiB stretch has the whole 2 MiB zeroed, so small pages
    halve the KV store's time in `bench.py --cpu` (benchmarks/HISTORY.md)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps `memory` alive


def kv_block_bytes(config: Config, dtype: torch.dtype) -> int:
    """Bytes of one block on one tensor-parallel rank."""
    return math.prod(kv_cache_shape(config, 1)) * dtype.itemsize


@dataclass(slots=True)
class GpuMemory:
    """Bytes, as torch reports them after the warm-up."""

    total: int  # the card
    free: int  # not in use by any process
    peak: int  # most this process's allocator held at once (the warm-up's peak)
    current: int  # what it holds now (the weights, mostly)

    @classmethod
    def measure(cls, device: torch.device) -> "GpuMemory":
        free, total = torch.cuda.mem_get_info(device)
        stats = torch.cuda.memory_stats(device)
        return cls(total, free, stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"])


def num_kvcache_blocks(
    config: Config, block_bytes: int, gpu: GpuMemory | None = None, agree: Callable[[int], int] = lambda n: n
) -> int:
    """The block count: `config.num_kvcache_blocks` if set (> 0); else, on a GPU (`gpu` given), the room
    left under `gpu_memory_utilization` once the peak activations are back; on CPU, the byte budget, capped
    at max_num_seqs sequences of max_model_len tokens. `agree` lets the tensor-parallel ranks settle on
    the smallest count before it is checked. Raises when no block fits."""
    c = config
    if c.num_kvcache_blocks > 0:
        n = c.num_kvcache_blocks
    elif gpu is not None:
        used_by_others = gpu.total - gpu.free - gpu.current  # other processes, and our cached-but-free memory
        room = gpu.total * c.gpu_memory_utilization - used_by_others - gpu.peak
        n = int(room) // block_bytes
    else:
        most = c.max_num_seqs * -(-c.max_model_len // c.kvcache_block_size)  # every sequence at full length
        n = min(c.cpu_kvcache_bytes // block_bytes, most)
    n = agree(n)
    if n < 1:
        if gpu is not None and c.num_kvcache_blocks <= 0:
            why = (
                f"gpu_memory_utilization={c.gpu_memory_utilization} of the GPU is already in use (another LLM "
                "alive in this process? call its exit(), or raise gpu_memory_utilization)"
            )
        else:
            why = f"the KV cache budget is too small (cpu_kvcache_bytes={c.cpu_kvcache_bytes})"
        raise RuntimeError(f"no memory left for the KV cache (one block needs {block_bytes} bytes): {why}")
    return n
