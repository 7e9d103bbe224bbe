"""The operators of one Qwen3 layer (notebooks 01-04) against transformers' own modules:
RMSNorm (plain and fused residual add) vs Qwen3RMSNorm, RoPE vs Qwen3RotaryEmbedding + apply_rotary_pos_emb,
SiluAndMul + merged gate_up + down vs Qwen3MLP, and the weight loaders of the parallel Linear family (TP=1;
the sharded cases are in test_tp.py)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP as HFQwen3MLP
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from conftest import assert_close
from minivllm.kernels import KernelOptions, pick
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from minivllm.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_theta_of
from minivllm.models.qwen3 import Qwen3MLP


def ops(device: str = "cpu", **options):
    """The kernel table an engine on `device` with these kernel options runs."""
    return pick(device, options=KernelOptions(**options))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- RMSNorm -----------------------------------------------------------------------------------------


def _norms(hidden: int, dtype: torch.dtype) -> tuple[RMSNorm, Qwen3RMSNorm]:
    ours, ref = RMSNorm(hidden, eps=1e-6), Qwen3RMSNorm(hidden, eps=1e-6)
    w = 1.0 + 0.1 * torch.randn(hidden)
    ours.weight.data.copy_(w)
    ref.weight.data.copy_(w)
    return ours.to(dtype), ref.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_qwen3_rmsnorm(dtype):
    ours, ref = _norms(64, dtype)
    x = (3 * torch.randn(2, 5, 64) + 1).to(dtype)  # not zero-mean: not a LayerNorm
    assert_close(ours(x), ref(x))
    assert ours(x).dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_rmsnorm(dtype):
    ours, ref = _norms(64, dtype)
    x, residual = torch.randn(7, 64).to(dtype), torch.randn(7, 64).to(dtype)
    y, new_residual = ours(x, residual)
    total = x.float() + residual.float()  # the add happens in fp32
    assert torch.equal(new_residual, total.to(dtype))  # residual returned = x + residual
    assert_close(y, ref(total.to(dtype)), dtype=dtype)
    if dtype == torch.float32:
        assert torch.equal(new_residual, x + residual)


def test_rmsnorm_variance_in_fp32():
    """Large values whose squares overflow fp16: the fp32 variance keeps them exact."""
    norm = RMSNorm(8).to(torch.float16)
    x = torch.full((1, 8), 1000.0, dtype=torch.float16)  # 1000^2 = 1e6 > fp16 max 65504
    assert torch.isinf(x.pow(2)).all()
    assert torch.equal(norm(x), torch.ones(1, 8, dtype=torch.float16))


def test_rmsnorm_shape_errors():
    norm = RMSNorm(64)
    with pytest.raises(ValueError, match=r"last dim of input is 32, expected 64"):
        norm(torch.randn(3, 32))
    with pytest.raises(ValueError, match=r"residual shape \(3, 63\) != input shape \(3, 64\)"):
        norm(torch.randn(3, 64), torch.randn(3, 63))


# The Triton kernels (what CUDA runs): on a GPU compiled, on CPU through the interpreter, against the torch
# definitions. The interpreter truncates fp32 -> bf16 where a GPU rounds to nearest: bf16 within two bf16 steps.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _triton_tolerance(dtype: torch.dtype) -> dict:
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}.get(
        dtype, dict(atol=2e-2, rtol=2e-2)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 96), (2, 3, 64), (0, 64)])
def test_rmsnorm_triton_kernel_matches_torch(dtype, shape):
    norm, _ = _norms(shape[-1], dtype)  # the torch definitions, eager
    fast = RMSNorm(shape[-1], eps=1e-6, ops=ops(TRITON_DEVICE, triton_on_cpu=True))  # our kernels, the same weight
    fast.weight.data.copy_(norm.weight)
    norm, fast = norm.to(TRITON_DEVICE), fast.to(dtype).to(TRITON_DEVICE)
    x = (3 * torch.randn(shape) + 1).to(dtype).to(TRITON_DEVICE)
    residual = torch.randn(shape).to(dtype).to(TRITON_DEVICE)
    y_ref, (z_ref, r_ref) = norm(x), norm(x, residual)
    y, (z, r) = fast(x), fast(x, residual)
    for got, want in ((y, y_ref), (z, z_ref), (r, r_ref)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_close(got, want, **_triton_tolerance(dtype))
    if dtype != torch.bfloat16 or TRITON_DEVICE == "cuda":  # the sum rounds to the same value
        assert torch.equal(r, r_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 2 * 1500), (2, 3, 2 * 40), (0, 8)])
def test_silu_and_mul_triton_kernel_matches_torch(dtype, shape):
    act, fast = SiluAndMul(), SiluAndMul(ops=ops(TRITON_DEVICE, triton_on_cpu=True))
    x = (2 * torch.randn(shape)).to(dtype).to(TRITON_DEVICE)
    want = act(x)
    got = fast(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    assert_close(got, want, **_triton_tolerance(dtype))


def test_small_ops_route_to_triton_only_where_asked():
    """A CPU engine's table runs the torch definitions (or C++) unless triton_on_cpu; the compile option takes the
    torch.compile path instead, or eager torch; a GPU engine's runs our kernels and compiles the rest. A layer
    binds what its table holds when it is built."""
    from minivllm.kernels.triton import activation, layernorm
    from minivllm.layers import layernorm as torch_layernorm

    assert ops(cpu_ops=False).rms_norm is None and not ops(cpu_ops=False).compile
    assert ops(triton_on_cpu=True).rms_norm is layernorm.rms_norm
    compiled = ops(triton_on_cpu=True, compile=True)
    assert compiled.rms_norm is None and compiled.silu_and_mul is None and compiled.compile
    eager = ops(triton_on_cpu=True, compile=False)
    assert eager.rms_norm is None and not eager.compile
    assert RMSNorm(8, ops=ops(triton_on_cpu=True))._rms_norm is layernorm.rms_norm
    assert SiluAndMul(ops=ops(triton_on_cpu=True))._silu_and_mul is activation.silu_and_mul
    assert RMSNorm(8, ops=eager)._add_rms_norm is torch_layernorm.add_rms_norm  # the definition itself
    assert RMSNorm(8, ops=compiled)._rms_norm is not torch_layernorm.rms_norm  # a torch.compile of it
    assert RMSNorm(8, ops=compiled)._rms_norm is RMSNorm(16, ops=compiled)._rms_norm  # one per definition, shared
    gpu = pick("cuda")  # a table only: nothing runs
    assert gpu.rms_norm is layernorm.rms_norm and gpu.attention_prologue is not None and gpu.compile
    with pytest.raises(ValueError, match="unknown kernel option"):
        KernelOptions.of({"triton_on_gpu": True})
    with pytest.raises(ValueError, match="last dim 7 is odd"):
        SiluAndMul()(torch.zeros(2, 7))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_small_ops_run_triton_on_cuda_without_dynamo():
    """On CUDA the default path is the Triton kernels: a fresh norm and activation compile nothing in dynamo."""
    from torch._dynamo.utils import counters

    table = pick("cuda", torch.bfloat16)
    norm, act = RMSNorm(64, ops=table).cuda().bfloat16(), SiluAndMul(ops=table)
    before = int(counters["stats"]["unique_graphs"])
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    norm(x), norm(x, x), act(torch.cat([x, x], dim=-1))
    assert int(counters["stats"]["unique_graphs"]) == before


@pytest.mark.slow
def test_rmsnorm_compiled_matches_eager():
    """The torch.compile path (nano-vllm's; the `compile` kernel option), forced on CPU for one small op."""
    norm, _ = _norms(16, torch.float32)
    fast = RMSNorm(16, eps=1e-6, ops=ops(compile=True))
    fast.weight.data.copy_(norm.weight)
    x, r = torch.randn(4, 16), torch.randn(4, 16)
    assert_close(fast(x), norm(x))
    for got, want in zip(fast(x, r), norm(x, r)):
        assert_close(got, want)


# --- RoPE --------------------------------------------------------------------------------------------


def _hf_rope(head_dim: int, theta: float, max_pos: int) -> Qwen3RotaryEmbedding:
    config = Qwen3Config(
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    return Qwen3RotaryEmbedding(config)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (16, 8)])
def test_rope_matches_transformers(heads, kv_heads):
    head_dim, theta, max_pos = 64, 1e6, 4096
    ours = RotaryEmbedding(head_dim, head_dim, max_pos, theta)
    positions = torch.tensor([0, 1, 2, 17, 5, 4095, 1000, 3])  # arbitrary, unordered, packed
    q = torch.randn(len(positions), heads, head_dim)  # (N, heads, D)
    k = torch.randn(len(positions), kv_heads, head_dim)  # (N, kv_heads, D)
    cos, sin = _hf_rope(head_dim, theta, max_pos)(q, positions[None])  # 2 x (1, N, D)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)
    q_out, k_out = ours(positions, q, k)
    assert_close(q_out, q_ref, atol=1e-5, rtol=1e-4)
    assert_close(k_out, k_ref, atol=1e-5, rtol=1e-4)
    assert_close(q_out.norm(dim=-1), q.norm(dim=-1), atol=1e-4, rtol=1e-4)  # a rotation keeps lengths


def test_rope_bf16_matches_transformers():
    ours = RotaryEmbedding(32, 32, 256, 10000.0)
    positions = torch.arange(10)
    q, k = torch.randn(10, 4, 32, dtype=torch.bfloat16), torch.randn(10, 2, 32, dtype=torch.bfloat16)
    cos, sin = _hf_rope(32, 10000.0, 256)(q.float(), positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.float(), k.float(), cos[0], sin[0], unsqueeze_dim=1)
    q_out, k_out = ours(positions, q, k)
    assert q_out.dtype == torch.bfloat16
    assert_close(q_out, q_ref.to(torch.bfloat16), dtype=torch.bfloat16)
    assert_close(k_out, k_ref.to(torch.bfloat16), dtype=torch.bfloat16)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(64, 64, 2048, 10000.0)
    q, k = torch.randn(1, 1, 64), torch.randn(1, 1, 64)

    def score(m: int, n: int) -> float:  # q at position m, k at position n
        qm, _ = rope(torch.tensor([m]), q, k)
        _, kn = rope(torch.tensor([n]), q, k)
        return (qm * kn).sum().item()

    base = score(5, 2)  # distance 3
    for shift in (1, 10, 100, 1000):
        assert score(5 + shift, 2 + shift) == pytest.approx(base, abs=1e-4)
    assert abs(score(5, 2) - score(5, 4)) > 1e-3  # a different distance differs


def test_get_rope_is_shared():
    a = get_rope(16, 16, 128, 10000.0, None)
    assert get_rope(16, 16, 128, 10000.0, None) is a  # every layer gets the same cache
    b = get_rope(16, 16, 128, 500000.0, None)
    assert b is not a and not torch.equal(b.cos_sin_cache, a.cos_sin_cache)
    with pytest.raises(NotImplementedError, match="rope scaling"):
        get_rope(16, 16, 128, 10000.0, (("factor", 8.0), ("rope_type", "yarn")))


def test_rope_theta_of():
    assert rope_theta_of(Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6})) == 1e6
    assert rope_theta_of(Qwen3Config(rope_theta=5e5)) == 5e5  # transformers 5 moves it into rope_parameters
    assert rope_theta_of(SimpleNamespace(rope_theta=10000)) == 10000.0  # older configs: top level
    with pytest.raises(ValueError, match="no rope_theta"):
        rope_theta_of(SimpleNamespace())


def test_rope_partial_rotary_rejected():
    with pytest.raises(ValueError, match="partial rotary"):
        RotaryEmbedding(64, 32, 16, 10000.0)


# --- SwiGLU MLP --------------------------------------------------------------------------------------


def test_silu_and_mul():
    x = torch.randn(5, 2 * 24)
    gate, up = x[:, :24], x[:, 24:]
    assert_close(SiluAndMul()(x), gate * torch.sigmoid(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_matches_qwen3_mlp(dtype):
    config = Qwen3Config(hidden_size=64, intermediate_size=96, hidden_act="silu")
    ref = HFQwen3MLP(config)
    ours = Qwen3MLP(64, 96, "silu")
    p = ours.gate_up_proj.weight
    p.weight_loader(p, ref.gate_proj.weight.data, 0)
    p.weight_loader(p, ref.up_proj.weight.data, 1)
    ours.down_proj.weight.weight_loader(ours.down_proj.weight, ref.down_proj.weight.data)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = torch.randn(9, 64).to(dtype)
    with torch.no_grad():
        assert_close(ours(x), ref(x))


def test_mlp_rejects_other_activations():
    with pytest.raises(ValueError, match="only silu"):
        Qwen3MLP(8, 16, "gelu")


# --- weight loaders ------------------------------------------------------------------------------------


def test_qkv_loader_string_shard_ids():
    hidden, head_dim, heads, kv_heads = 32, 8, 4, 2
    layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=True)
    w = {s: torch.randn(n * head_dim, hidden) for s, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    b = {s: torch.randn(t.shape[0]) for s, t in w.items()}
    for s in ("v", "q", "k"):  # any order: each goes to its offset
        layer.weight.weight_loader(layer.weight, w[s], s)
        layer.bias.weight_loader(layer.bias, b[s], s)
    assert layer.weight.shape == ((heads + 2 * kv_heads) * head_dim, hidden)
    assert torch.equal(layer.weight, torch.cat([w["q"], w["k"], w["v"]]))
    x = torch.randn(3, hidden)
    assert_close(layer(x), torch.cat([F.linear(x, w[s], b[s]) for s in "qkv"], -1))


def test_merged_loader_int_shard_ids():
    layer = MergedColumnParallelLinear(32, [48, 16])  # unequal parts: offsets must be right
    gate, up = torch.randn(48, 32), torch.randn(16, 32)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    assert torch.equal(layer.weight, torch.cat([gate, up]))


def test_column_row_replicated_loaders():
    w, b = torch.randn(24, 16), torch.randn(24)
    for cls in (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear):
        layer = cls(16, 24, bias=True)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        x = torch.randn(2, 16)
        assert_close(layer(x), F.linear(x, w, b))


def test_loader_shape_mismatch_names_layer_and_shard():
    qkv = QKVParallelLinear(32, 8, 4, 2)
    with pytest.raises(
        ValueError,
        match=r"QKVParallelLinear\[k\]: checkpoint shape \(24, 32\) does not match parameter shard shape \(16, 32\)",
    ):
        qkv.weight.weight_loader(qkv.weight, torch.randn(24, 32), "k")
    merged = MergedColumnParallelLinear(32, [48, 48])
    with pytest.raises(ValueError, match=r"MergedColumnParallelLinear\[1\]: .*\(48, 31\).*\(48, 32\)"):
        merged.weight.weight_loader(merged.weight, torch.randn(48, 31), 1)
    row = RowParallelLinear(16, 24)
    with pytest.raises(ValueError, match=r"RowParallelLinear: checkpoint shape \(24, 15\)"):
        row.weight.weight_loader(row.weight, torch.randn(24, 15))
    col = ColumnParallelLinear(16, 24)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: input last dim 8 != in_features 16"):
        col(torch.randn(2, 8))


def test_get_rope_is_one_module_per_kernel_table():
    """Every layer of one model shares one RotaryEmbedding; a model built with other kernels gets its own (bound to
    its table's rotary), not the first model's."""
    from dataclasses import replace

    from minivllm.layers.rotary_embedding import rotary

    def kernel(positions, q, k, cos_sin_cache):  # a stand-in rotary kernel
        return rotary(positions, q, k, cos_sin_cache)

    get_rope.cache_clear()
    eager = ops(cpu_ops=False)
    first = get_rope(16, 16, 64, 10000.0, ops=eager)
    assert get_rope(16, 16, 64, 10000.0, ops=eager) is first and first._rotary is rotary
    other = get_rope(16, 16, 64, 10000.0, ops=replace(eager, rotary=kernel))
    assert other is not first and other._rotary is kernel
    get_rope.cache_clear()
