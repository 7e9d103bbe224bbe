"""The fused attention prologue (minivllm/kernels/triton/attention_prologue.py): one Triton kernel does per-head
QK-norm, RoPE and the KV-cache write. On CPU it runs through the Triton interpreter and must match the
separate ops the CPU path runs (RMSNorm, RotaryEmbedding, store_kvcache_torch); on a GPU the whole model
must give the same logits with the kernel on and off."""

import pytest
import torch

from conftest import assert_close
from minivllm.kernels.triton.attention_prologue import attention_prologue as prologue
from minivllm.layers.attention import store_kvcache_torch
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.rotary_embedding import RotaryEmbedding

NUM_BLOCKS, BLOCK_SIZE = 4, 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the compiled kernel on a GPU, the interpreter on CPU


def separate_ops(qkv, positions, rope, q_norm, k_norm, heads, kv_heads, head_dim, k_cache, v_cache, slots):
    """The unfused path, as Qwen3Attention runs it on CPU."""
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.reshape(-1, heads, head_dim), k.reshape(-1, kv_heads, head_dim), v.reshape(-1, kv_heads, head_dim)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = rope(positions, q, k)
    if k_cache.numel():
        store_kvcache_torch(k, v, k_cache, v_cache, slots)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,qk_norm",
    [(4, 2, 16, True), (3, 1, 12, False), (9, 3, 64, True)],
    ids=["qwen3-gqa", "no-norm-odd-heads", "smollm2-shape"],
)
def test_prologue_matches_separate_ops(dtype, heads, kv_heads, head_dim, qk_norm):
    g = torch.Generator().manual_seed(heads * head_dim)
    n = 7
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g) * 2).to(DEVICE, dtype)
    positions = torch.tensor([0, 5, 9, 3, 100, 2, 7], device=DEVICE)
    with torch.device(DEVICE):
        rope = RotaryEmbedding(head_dim, head_dim, 128, 10000.0)
    q_norm = k_norm = None
    if qk_norm:
        q_norm, k_norm = RMSNorm(head_dim).to(DEVICE), RMSNorm(head_dim).to(DEVICE)
        q_norm.weight.data = (torch.rand(head_dim, generator=g) + 0.5).to(DEVICE, dtype)
        k_norm.weight.data = (torch.rand(head_dim, generator=g) + 0.5).to(DEVICE, dtype)
    slots = torch.tensor([3, -1, 0, 15, 7, 8, 1], dtype=torch.int32, device=DEVICE)  # -1: padding, not stored
    caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)]
    q, k, v = prologue(
        qkv,
        positions,
        rope.cos_sin_cache,
        heads,
        kv_heads,
        head_dim,
        q_norm.weight if qk_norm else None,
        k_norm.weight if qk_norm else None,
        1e-6,
        caches[0],
        caches[1],
        slots,
    )
    rq, rk, rv = separate_ops(
        qkv, positions, rope, q_norm, k_norm, heads, kv_heads, head_dim, caches[2], caches[3], slots
    )
    # fp32: the same arithmetic; bf16: the interpreter truncates fp32 -> bf16 where torch rounds (<= 1 ulp per cast)
    assert_close(q.float(), rq.float(), dtype=dtype)
    assert_close(k.float(), rk.float(), dtype=dtype)
    assert torch.equal(v, rv)
    assert_close(caches[0].float(), caches[2].float(), dtype=dtype)
    assert torch.equal(caches[1], caches[3])
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0].long()] = True
    assert (caches[1].view(NUM_BLOCKS * BLOCK_SIZE, -1)[~written] == 0).all()  # nothing else touched
    assert (caches[1].view(NUM_BLOCKS * BLOCK_SIZE, -1)[written] != 0).any(dim=-1).all()


def test_prologue_without_a_cache_stores_nothing():
    """Warm-up runs before the KV cache exists: the kernel then only normalises and rotates."""
    heads, kv_heads, head_dim = 2, 1, 8
    qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim, device=DEVICE)
    with torch.device(DEVICE):
        rope = RotaryEmbedding(head_dim, head_dim, 16, 10000.0)
        w, empty, pos = torch.ones(head_dim), torch.tensor([]), torch.arange(3)
        norms = RMSNorm(head_dim), RMSNorm(head_dim)
    q, k, v = prologue(qkv, pos, rope.cos_sin_cache, heads, kv_heads, head_dim, w, w, 1e-6, empty, empty, None)
    rq, rk, _ = separate_ops(qkv, pos, rope, *norms, heads, kv_heads, head_dim, empty, empty, None)
    assert_close(q, rq)
    assert_close(k, rk)
    assert v.data_ptr() == qkv[:, (heads + kv_heads) * head_dim :].data_ptr()  # v is a view, not a copy


def test_prologue_rejects_a_wrong_qkv_width():
    rope = RotaryEmbedding(8, 8, 16, 10000.0)
    with pytest.raises(AssertionError, match="qkv shape"):
        prologue(
            torch.randn(3, 30),
            torch.arange(3),
            rope.cos_sin_cache,
            2,
            1,
            8,
            None,
            None,
            0.0,
            torch.tensor([]),
            torch.tensor([]),
            None,
        )


@pytest.mark.gpu
def test_gpu_model_logits_with_and_without_the_fused_prologue(tiny_qwen3):
    """The same engine step on CUDA (fp32, torch attention) with the fused kernel and with the separate ops."""
    from minivllm import LLM, SamplingParams

    prompts = [[(7 * i + n) % 500 for i in range(n)] for n in (5, 40, 1, 90)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = []
    for fused in (True, False):
        kernels = dict(fused_prologue=fused)
        llm = LLM(tiny_qwen3, device="cuda", dtype="float32", enforce_eager=True, max_model_len=256, kernels=kernels)
        runs.append([o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        llm.exit()
    assert runs[0] == runs[1]
