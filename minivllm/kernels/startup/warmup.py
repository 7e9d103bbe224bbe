"""Start-up work of a GPU engine (the model runner calls it around sizing the KV cache): compile every kernel
the first requests would otherwise compile, and learn the largest prefill's peak memory. On CPU nothing
compiles and the KV cache has a byte budget, so none of it runs there. `runner` is the engine's ModelRunner."""

import numpy as np
import torch

from minivllm.engine import step_inputs
from minivllm.engine.kv_cache import kv_cache_shape
from minivllm.engine.sequence import Sequence
from minivllm.frontend.sampling_filters import sample
from minivllm.kernels import attention_backends
from minivllm.kernels.startup.attention_compile import attention_warmup_tokens


@torch.inference_mode()
def warmup_model(runner) -> None:
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
    # A backend that reads every prefill's keys from the cache (FlashAttention-4) lends the layers torch's attention
    # for this step (its memory, the output, is the same); warmup_attention compiles its kernel once the real
    # cache exists.
    inp.slot_mapping = np.full_like(inp.slot_mapping, -1)
    runner.bind_kv_cache(torch.zeros(kv_cache_shape(c, 1), dtype=runner.dtype, device=runner.device))
    backends = [m.backend for m in runner.attn_layers]
    if runner.prefill_keys_from_cache:
        fresh_keys = attention_backends.create("torch")
        for m in runner.attn_layers:
            m.backend = fresh_keys
    try:
        runner.run_model(inp)
    finally:
        runner.bind_kv_cache(None)
        for m, backend in zip(runner.attn_layers, backends):
            m.backend = backend
    if runner.rank == 0:
        logits = torch.zeros(c.max_num_seqs, c.hf_config.vocab_size, device=runner.device, dtype=runner.dtype)
        t = torch.ones(c.max_num_seqs, device=runner.device)
        sample(runner.sampler, logits, t, torch.ones_like(t, dtype=torch.int32), t)  # the filters' path (fp32)
    if cuda:
        torch.cuda.synchronize()


@torch.inference_mode()
def warmup_attention(runner) -> None:
    """One prefill whose keys come partly from the cache (one block "cached", up to 512 new tokens), once the
    cache exists. FlashAttention-4 compiles each kernel variant on first use (~3-4 s); with it every prefill
    is this one variant (model_runner.py), compiled here, or ahead by attention_compile.py's thread or helper
    process (waited for first), and not inside the first request. Writes a few slots of the still unused cache."""
    runner.compile_ahead.wait_attention()  # a thread's errors raise here
    c = runner.config
    cached, new, blocks = attention_warmup_tokens(c)
    seq = Sequence([0] * (cached + new))
    seq.block_table = [b % c.num_kvcache_blocks for b in range(blocks)]
    seq.num_computed_tokens, seq.num_scheduled_tokens = cached, new
    runner.run_model(runner.prepare_prefill([seq]))
