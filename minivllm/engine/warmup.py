"""Start-up work of a GPU engine (the model runner calls it before it sizes the KV cache and captures graphs):
compile every kernel the first requests would otherwise compile, and learn the largest prefill's peak memory.
On CPU nothing compiles and the KV cache has a byte budget, so none of it runs there."""

from typing import TYPE_CHECKING

import torch

from minivllm.engine.sequence import Sequence

if TYPE_CHECKING:
    from minivllm.engine.model_runner import ModelRunner


@torch.inference_mode()
def warmup_model(runner: "ModelRunner") -> None:
    """Run the largest prefill (and the sampler on the largest batch) once, so that kernels are compiled
    and the peak activation memory is known before the KV cache takes the rest (GPU only)."""
    c = runner.config
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    seq_len = min(c.max_model_len, c.max_num_batched_tokens)
    num_seqs = max(1, min(c.max_num_batched_tokens // seq_len, c.max_num_seqs))
    seqs = [Sequence([0] * seq_len) for _ in range(num_seqs)]
    for s in seqs:
        s.num_scheduled_tokens = seq_len
        s.block_table = list(range(runner.max_num_blocks))
    runner.run_model(runner.prepare_prefill(seqs))
    if runner.rank == 0:
        logits = torch.zeros(c.max_num_seqs, c.hf_config.vocab_size, device=runner.device, dtype=runner.dtype)
        t = torch.ones(c.max_num_seqs, device=runner.device)
        runner.sampler(logits, t, torch.ones_like(t, dtype=torch.int32), t)
    torch.cuda.synchronize()


@torch.inference_mode()
def warmup_prefill_variants(runner: "ModelRunner") -> None:
    """Prefill kernels come in variants that FlashAttention-4 compiles on first use (2-3 s each): keys
    fresh or partly from the cache (a prefix hit, a later chunk), and queries that fit in one tile or
    not. warmup_model ran the fresh long one; run the other three now, not inside the first requests
    (benchmarks/NOTES.md). Writes a few slots of the still unused cache."""
    c = runner.config
    cached = runner.block_size  # one block of keys "from the cache"
    room = min(c.max_num_batched_tokens, c.max_model_len - cached)  # positions must stay in the model's range
    for num_cached, num_new in [(0, 1)] + [(cached, n) for n in (8, min(512, room)) if 1 <= n <= room]:
        seq = Sequence([0] * (num_cached + num_new))
        blocks = -(-(num_cached + num_new) // runner.block_size)
        seq.block_table = [b % runner.config.num_kvcache_blocks for b in range(blocks)]
        seq.num_computed_tokens, seq.num_scheduled_tokens = num_cached, num_new
        runner.run_model(runner.prepare_prefill([seq]))
