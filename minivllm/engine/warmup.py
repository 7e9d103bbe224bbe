"""Start-up work of a GPU engine (the model runner calls it around sizing the KV cache): compile every kernel
the first requests would otherwise compile, and learn the largest prefill's peak memory. On CPU nothing
compiles and the KV cache has a byte budget, so none of it runs there."""

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from minivllm.config import Config
from minivllm.engine import step_inputs
from minivllm.engine.kv_cache import kv_cache_shape
from minivllm.engine.sequence import Sequence
from minivllm.layers import attention_backend
from minivllm.utils.switches import SWITCHES

if TYPE_CHECKING:
    from minivllm.engine.model_runner import ModelRunner


@torch.inference_mode()
def warmup_model(runner: "ModelRunner") -> None:
    """Run the largest prefill (and the sampler on the largest batch) once, so that kernels are compiled
    and the peak activation memory is known before the KV cache takes the rest (GPU only)."""
    c = runner.config
    cuda = runner.device.type == "cuda"  # (the engine runs this on GPUs only; tests run it on CPU too)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    seq_len = min(c.max_model_len, c.max_num_batched_tokens)
    num_seqs = max(1, min(c.max_num_batched_tokens // seq_len, c.max_num_seqs))
    seqs = [Sequence([0] * seq_len) for _ in range(num_seqs)]
    for s in seqs:
        s.num_scheduled_tokens = seq_len
        s.block_table = list(range(runner.max_num_blocks))
    inp = step_inputs.prepare_prefill(seqs, runner.block_size)  # fresh keys: there is no cache yet
    # The layers get a one-block stand-in cache that nothing is written to (every slot -1): their kernels
    # compile the variant that stores into a cache, the one every later step runs (Triton specialises on it).
    # A backend that reads every prefill's keys from the cache (FlashAttention-4, model_runner.py) lends
    # the warm-up torch's attention (its memory, the output, is the same); warmup_attention compiles its
    # kernel once the real cache exists.
    inp.slot_mapping = np.full_like(inp.slot_mapping, -1)
    stand_in = torch.zeros(kv_cache_shape(c, 1), dtype=runner.dtype, device=runner.device)
    saved = [(m.backend, m.k_cache, m.v_cache) for m in runner.attn_layers]
    for i, m in enumerate(runner.attn_layers):
        m.k_cache, m.v_cache = stand_in[0, i], stand_in[1, i]
        m.backend = "torch" if runner.prefill_keys_from_cache else m.backend
    try:
        runner.run_model(inp)
    finally:
        for m, (backend, k_cache, v_cache) in zip(runner.attn_layers, saved):
            m.backend, m.k_cache, m.v_cache = backend, k_cache, v_cache
        del stand_in
    if runner.rank == 0:
        logits = torch.zeros(c.max_num_seqs, c.hf_config.vocab_size, device=runner.device, dtype=runner.dtype)
        t = torch.ones(c.max_num_seqs, device=runner.device)
        runner.sampler(logits, t, torch.ones_like(t, dtype=torch.int32), t)
    if cuda:
        torch.cuda.synchronize()


def attention_warmup_tokens(config: Config) -> tuple[int, int, int]:
    """(cached, new, blocks) of the attention warm-up's one prefill: one block of tokens from the cache (when a
    prefix can be cached at all), up to 512 new tokens, and the blocks the two fill."""
    block_size = config.kvcache_block_size
    cached = block_size if config.max_model_len > block_size else 0  # a cached prefix needs room after it
    new = min(512, config.max_num_batched_tokens, config.max_model_len - cached)
    return cached, new, -(-(cached + new) // block_size)


def start_attention_compile(runner: "ModelRunner") -> Future | None:
    """FlashAttention-4 compiles its one prefill kernel (~4 s on a bare machine) on a thread, over a stand-in
    cache of a few blocks, while the runner loads the model and its warm-up prefill compiles the Triton kernels
    (they overlap only where one gives up the interpreter lock: ~3.4 of ~5.8 s, benchmarks/NOTES.md change 21).
    Its compile key holds the dtypes, head counts, page size and which arguments are given, not the sizes, so
    the stand-in's kernel is the one every prefill runs. warmup_attention waits for it. With its on-disk cache
    the thread only loads the kernel."""
    if runner.device.type != "cuda" or runner.backend != "fa4" or not SWITCHES.early_attention_compile:
        return None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-attention-compile")
    future = pool.submit(stand_in_prefill_attention, runner.config, runner.device, runner.dtype)
    pool.shutdown(wait=False)  # its one thread ends with the job
    return future


@torch.inference_mode()
def stand_in_prefill_attention(config: Config, device: torch.device, dtype: torch.dtype, backend: str = "fa4") -> None:
    """The attention of warmup_attention's prefill alone, on zeros in a stand-in cache (on a side stream on a
    GPU): the same call as the layer's, so the same kernel (tests/test_startup.py compares the two)."""
    _, _, _, block_size, kv_heads, head_dim = kv_cache_shape(config, 1)
    heads = config.hf_config.num_attention_heads // config.tensor_parallel_size
    cached, new, blocks = attention_warmup_tokens(config)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(stream):  # makes the stream's device current too; no-op for None (CPU)
        q = torch.zeros(new, heads, head_dim, dtype=dtype, device=device)  # (new, H, D)
        k_cache = torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        attention_backend.prefill_paged(
            backend,
            q,
            k_cache,
            torch.zeros_like(k_cache),
            cu_seqlens_q=torch.tensor([0, new], **i32),
            cu_seqlens_k=torch.tensor([0, cached + new], **i32),
            max_seqlen_q=new,
            max_seqlen_k=cached + new,
            context_lens=torch.tensor([cached + new], **i32),
            block_tables=torch.arange(blocks, **i32).view(1, blocks),  # (1, blocks)
            scale=head_dim**-0.5,
        )
    if stream is not None:
        stream.synchronize()


@torch.inference_mode()
def warmup_attention(runner: "ModelRunner") -> None:
    """One prefill whose keys come partly from the cache (one block "cached", up to 512 new tokens), once the
    cache exists. FlashAttention-4 compiles each kernel variant on first use (~3-4 s); with it every prefill
    is this one variant (model_runner.py), compiled here, or on start_attention_compile's thread (waited for
    here), and not inside the first request. Writes a few slots of the still unused cache."""
    if runner.attention_compile is not None:
        future, runner.attention_compile = runner.attention_compile, None
        future.result()  # the thread's errors raise here
    c = runner.config
    cached, new, blocks = attention_warmup_tokens(c)
    seq = Sequence([0] * (cached + new))
    seq.block_table = [b % c.num_kvcache_blocks for b in range(blocks)]
    seq.num_computed_tokens, seq.num_scheduled_tokens = cached, new
    runner.run_model(runner.prepare_prefill([seq]))
