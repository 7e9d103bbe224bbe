"""Programmatic dependent launch (`pdl_args` and its two kernels, minivllm/kernels/triton/paged_decode.py): off on
CPU (the interpreter never sees it); on a Hopper GPU the chain prologue -> paged decode -> split combine, captured in
a CUDA graph with PDL, gives exactly what the same kernels give launched one after the other without it, and so does
the whole engine."""

import pytest
import torch

from minivllm.kernels.triton.attention_prologue import attention_prologue
from minivllm.kernels.triton.paged_decode import paged_decode, pdl_args
from minivllm.layers.rotary_embedding import RotaryEmbedding

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_pdl_is_off_on_cpu():
    x = torch.zeros(2)
    assert pdl_args(x.device) == {"PDL": False} and pdl_args(x.device, False) == {"PDL": False}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch", [8, 64])  # 8: split-KV, so the combine kernel runs too
def test_gpu_prologue_decode_chain_in_a_graph_equals_plain_launches(batch):
    torch.manual_seed(batch)
    H, Hkv, D, page, layers = 16, 8, 128, 256, 12
    dev, dt = "cuda", torch.bfloat16
    rope = RotaryEmbedding(D, D, 4096, 1e6).to(dev)
    ctx = torch.randint(100, 1500, (batch,), device=dev, dtype=torch.int32)
    pages = (int(ctx.max()) + page - 1) // page
    tables = torch.randperm(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)
    slots = tables.gather(1, ((ctx - 1) // page).long()[:, None])[:, 0] * page + (ctx - 1) % page
    positions = (ctx - 1).long()
    qkv = torch.randn(layers, batch, (H + 2 * Hkv) * D, device=dev, dtype=dt)
    qn, kn = torch.rand(D, device=dev, dtype=dt) + 0.5, torch.rand(D, device=dev, dtype=dt) + 0.5
    caches = torch.randn(layers, 2, batch * pages, page, Hkv, D, device=dev, dtype=dt)

    def step(kv, use_pdl: bool = True) -> list[torch.Tensor]:
        outs = []
        for i in range(layers):
            q, _, _ = attention_prologue(
                qkv[i], positions, rope.cos_sin_cache, H, Hkv, D, qn, kn, 1e-6, kv[i, 0], kv[i, 1], slots, use_pdl
            )
            outs.append(paged_decode(q, kv[i, 0], kv[i, 1], ctx, tables, D**-0.5, use_pdl=use_pdl))
        return outs

    plain_cache = caches.clone()
    plain = step(plain_cache, use_pdl=False)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl_args(qkv.device) == ({"PDL": True, "launch_pdl": True} if hopper else {"PDL": False})
    assert pdl_args(qkv.device, False) == {"PDL": False}
    graph_cache = caches.clone()
    step(graph_cache.clone())  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(graph_cache)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_cache, plain_cache)  # the prologue wrote the same K/V
    for got, ref in zip(outs, plain):
        assert torch.equal(got, ref)


@pytest.mark.gpu
@gpu
def test_gpu_engine_tokens_with_and_without_pdl(tiny_qwen3):
    from minivllm import LLM, SamplingParams

    prompts = [[(7 * i + n) % 500 for i in range(n)] for n in (5, 40, 1, 90)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for on in (True, False):
        for eager in (True, False):
            kw = dict(device="cuda", dtype="float32", enforce_eager=eager, max_model_len=256, kernels=dict(pdl=on))
            llm = LLM(tiny_qwen3, **kw)
            runs[on, eager] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            llm.exit()
    assert runs[True, True] == runs[False, True] == runs[True, False] == runs[False, False]
