"""The decode-batch kernels of a GPU step (minivllm/layers/skinny_gemm.py, the Triton RMSNorm in layernorm.py)
and their programmatic dependent launch (minivllm/utils/pdl.py). On CPU the kernels run through the Triton
interpreter (no PDL there) against torch; on a GPU the chain runs inside a CUDA graph with PDL against the
plain torch ops, and a whole model gives the same greedy tokens with the kernels on and off."""
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close

from minivllm.layers import skinny_gemm
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.layernorm import RMSNorm, rms_norm, rms_norm_triton
from minivllm.layers.skinny_gemm import skinny_linear
from minivllm.utils import pdl

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bf16_tol(ref: torch.Tensor) -> float:
    """A few bf16 steps at the output's scale (the interpreter rounds fp32 -> bf16 by truncation)."""
    return 4 * 2.0 ** -8 * ref.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 48, 64), (3, 100, 80), (17, 64, 256), (64, 40, 130)])
def test_skinny_linear_matches_f_linear(dtype, M, N, K):
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype)
    for bias in (None, b):
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        got = skinny_linear(x, w, bias)
        assert got.shape == (M, N) and got.dtype == dtype
        atol = 1e-4 if dtype == torch.float32 else bf16_tol(ref)
        assert_close(got.float(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,I,K", [(1, 24, 64), (5, 50, 96), (33, 32, 128)])
def test_skinny_silu_mul_matches_merged_projection_then_siluandmul(dtype, M, I, K):
    g = torch.Generator().manual_seed(M + I + K)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(2 * I, K, generator=g) / K ** 0.5).to(DEVICE, dtype)      # gate rows, then up rows
    ref = SiluAndMul()(F.linear(x, w))                                           # the unfused MLP path
    got = skinny_linear(x, w, silu_mul=True)
    assert got.shape == (M, I)
    atol = 1e-5 if dtype == torch.float32 else bf16_tol(ref)
    assert_close(got.float(), ref.float(), atol=atol, rtol=0)


def test_skinny_linear_errors():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="features"):
        skinny_linear(x, torch.randn(4, 6, device=DEVICE))
    with pytest.raises(ValueError, match="silu_mul"):
        skinny_linear(x, torch.randn(5, 8, device=DEVICE), silu_mul=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rmsnorm_matches_rmsnorm(dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96).to(DEVICE, dtype)
    norm.weight.data = torch.randn(96, generator=g).to(DEVICE, dtype)
    x = torch.randn(5, 96, generator=g).to(DEVICE, dtype)
    r = torch.randn(5, 96, generator=g).to(DEVICE, dtype)
    ref = norm.rms_forward(x)
    ref2, ref_res = norm.add_rms_forward(x, r)
    got = rms_norm_triton(x, norm.weight, norm.eps)
    got2, got_res = rms_norm_triton(x, norm.weight, norm.eps, r)
    if dtype == torch.float32:
        for a, b in ((got, ref), (got2, ref2), (got_res, ref_res)):
            assert_close(a, b, atol=1e-5, rtol=1e-5)
    else:
        for a, b in ((got, ref), (got2, ref2), (got_res, ref_res)):
            assert_close(a.float(), b.float(), atol=bf16_tol(b), rtol=0)


def test_decode_batch_dispatch():
    """Only CUDA tensors of at most MAX_M rows take the kernels; CPU always runs the torch ops."""
    x = torch.randn(4, 8)
    assert not skinny_gemm.decode_batch(x) and not skinny_gemm.enabled(x, torch.randn(6, 8))
    assert not pdl.enabled(x) and pdl.launch_kwargs(x) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pdl_chain_in_a_cuda_graph():
    """A decode layer's chain of our kernels (norm -> matmul -> norm -> gate/up+SwiGLU -> down), 28 layers deep,
    captured in a CUDA graph with PDL and replayed on new inputs, equals the plain torch ops (bf16, 0.6B shapes)."""
    torch.manual_seed(0)
    H, I, L = 1024, 3072, 28
    layers = [dict(n1=torch.rand(H, device="cuda", dtype=torch.bfloat16) + 0.5,
                   wo=torch.randn(H, 2048, device="cuda", dtype=torch.bfloat16) / 2048 ** 0.5,
                   n2=torch.rand(H, device="cuda", dtype=torch.bfloat16) + 0.5,
                   wgu=torch.randn(2 * I, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5,
                   wd=torch.randn(H, I, device="cuda", dtype=torch.bfloat16) / I ** 0.5) for _ in range(L)]
    eps = 1e-6

    def add_norm(h, res, w, ours: bool):
        if ours:
            return rms_norm_triton(h, w, eps, res)
        s = h.float() + res.float()
        return rms_norm(s, w, eps, h.dtype), s.to(h.dtype)

    def chain(h, res, ours: bool):
        for p in layers:
            h, res = add_norm(h, res, p["n1"], ours)
            a = torch.cat([h, h], dim=-1)                                  # (M, 2048): the attention output stand-in
            h = skinny_linear(a, p["wo"]) if ours else F.linear(a, p["wo"])
            h, res = add_norm(h, res, p["n2"], ours)
            g = skinny_linear(h, p["wgu"], silu_mul=True) if ours else SiluAndMul()(F.linear(h, p["wgu"]))
            h = skinny_linear(g, p["wd"]) if ours else F.linear(g, p["wd"])
        return h, res

    M = 8
    h_in = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    r_in = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    assert pdl.enabled(h_in) == (torch.cuda.get_device_capability()[0] >= 9)
    chain(h_in, r_in, True)                                                # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = chain(h_in, r_in, True)
    for seed in (1, 2):
        torch.manual_seed(seed)
        h_in.copy_(torch.randn(M, H, device="cuda"))
        r_in.copy_(torch.randn(M, H, device="cuda"))
        graph.replay()
        ref, ref_res = chain(h_in, r_in, False)
        assert_close(out.float(), ref.float(), atol=0.05 * ref.float().abs().max().item(), rtol=0)
        assert_close(res.float(), ref_res.float(), atol=0.05 * ref_res.float().abs().max().item(), rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_model_tokens_with_and_without_decode_kernels(tiny_qwen3):
    """The engine on CUDA (fp32, graphs and eager) gives the same greedy tokens with the decode-batch kernels
    and PDL as with cuBLAS, compiled norms and no PDL."""
    from minivllm import LLM, SamplingParams
    prompts = [[(7 * i + n) % 500 for i in range(n)] for n in (5, 40, 1, 90)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    max_m = skinny_gemm.MAX_M
    try:
        for ours in (True, False):
            skinny_gemm.set_max_m(max_m if ours else 0)
            pdl.set_enabled(ours)
            for eager in (True, False):
                llm = LLM(tiny_qwen3, device="cuda", dtype="float32", enforce_eager=eager, max_model_len=256)
                runs[ours, eager] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
                llm.exit()
    finally:
        skinny_gemm.set_max_m(max_m)
        pdl.set_enabled(True)
    assert runs[True, True] == runs[False, True] == runs[True, False] == runs[False, False]
