"""The C++ CPU operators (minivllm/kernels/cpu/csrc/, loaded by minivllm/kernels/cpu/ops.py) against the torch
definitions they stand in for: RMSNorm plain and with the residual add, RoPE, SiLU-mul, the KV-cache store and
paged decode attention, in fp32, bf16 and fp16, on strided inputs as the model passes them; bad inputs raise
ValueError naming the problem; the layers take the C++ path on CPU when the library is loaded and the switch is on;
an engine gives the same greedy tokens with and without it; without a build the engine runs the torch ops."""

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.kernels import KernelOptions, attention_backends, pick, torch_attention
from minivllm.kernels.cpu import build
from minivllm.kernels.cpu import ops as cpu_ops
from minivllm.layers import activation, attention, layernorm, rotary_embedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def library():
    """This machine's build (scripts/setup.sh makes it; built here if missing: a test that skipped would check
    nothing)."""
    build.build()
    cpu_ops._state.clear()
    assert cpu_ops.loaded(), cpu_ops.not_loaded_reason()


def within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 1) -> None:
    """Equal up to `ulps` units in the last place of the dtype (the order of an fp32 sum, an exp's last bit)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    eps = torch.finfo(actual.dtype).eps
    a, e = actual.double(), expected.double()
    bound = ulps * eps * e.abs().clamp(min=torch.finfo(actual.dtype).tiny) + (
        1e-6 if actual.dtype != torch.float32 else 0
    )
    bad = (a - e).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} values differ by more than {ulps} ulp, max diff {(a - e).abs().max():.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_rms_norms_match_torch(dtype, rows):
    torch.manual_seed(rows)
    x, r = torch.randn(rows, 96).to(dtype), torch.randn(rows, 96).to(dtype)
    norm = layernorm.RMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = (torch.rand(96) + 0.5).to(dtype)
    ulps = 4 if dtype == torch.float32 else 1  # fp32: the variance's sum in another order moves the last bits
    within_ulps(cpu_ops.rms_norm(x, norm.weight, 1e-5), layernorm.rms_norm(x, norm.weight, 1e-5), ulps)
    out, res = cpu_ops.add_rms_norm(x, r, norm.weight, 1e-5)
    want_out, want_res = layernorm.add_rms_norm(x, r, norm.weight, 1e-5)
    assert torch.equal(res, want_res)  # the new residual: one rounding of the fp32 sum
    within_ulps(out, want_out, ulps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_torch_on_views_of_qkv(dtype):
    torch.manual_seed(0)
    rope = rotary_embedding.RotaryEmbedding(64, 64, 512, 10000.0)
    qkv = torch.randn(13, (4 + 2 * 2) * 64).to(dtype)  # 4 query heads, 2 KV heads: q and k are strided views
    q, k = qkv[:, :256].view(13, 4, 64), qkv[:, 256:384].view(13, 2, 64)
    positions = torch.randint(0, 512, (13,))
    got, want = (
        cpu_ops.rotary(positions, q, k, rope.cos_sin_cache),
        rotary_embedding.rotary(positions, q, k, rope.cos_sin_cache),
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # the same roundings, in the same order


def test_rotary_rejects_a_position_past_its_table():
    rope = rotary_embedding.RotaryEmbedding(64, 64, 16, 10000.0)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    with pytest.raises(ValueError, match="position 16 outside"):
        cpu_ops.rotary(torch.tensor([3, 16]), q, k, rope.cos_sin_cache)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    torch.manual_seed(0)
    x = (torch.randn(9, 2 * 200) * 4).to(dtype)  # values far into both tails of the sigmoid
    x[0, :3] = torch.tensor([-100.0, 0.0, 100.0])
    gate, up = x.chunk(2, dim=-1)
    within_ulps(cpu_ops.silu_and_mul(x), F.silu(gate) * up, ulps=4 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_matches_index_assignment(dtype, slot_dtype):
    torch.manual_seed(0)
    qkv = torch.randn(6, (2 + 2 * 2) * 32).to(dtype)
    k, v = qkv[:, 64:128].view(6, 2, 32), qkv[:, 128:].view(6, 2, 32)  # strided, as the model passes them
    slots = torch.tensor([5, -1, 0, 17, -1, 9], dtype=slot_dtype)
    want_k, want_v = torch.zeros(3, 8, 2, 32, dtype=dtype), torch.zeros(3, 8, 2, 32, dtype=dtype)
    attention.store_kvcache_torch(k, v, want_k, want_v, slots)
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    cpu_ops.store_kvcache(k, v, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_store_rejects_a_slot_past_the_cache():
    k_cache = v_cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="slot 8 outside the cache's 8 rows"):
        cpu_ops.store_kvcache(torch.ones(1, 1, 8), torch.ones(1, 1, 8), k_cache, v_cache, torch.tensor([8]))


def paged_inputs(dtype, lens, heads, kv_heads, head_dim, block_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    width = max((n + block_size - 1) // block_size for n in lens) + 1
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=g).tolist()  # blocks in no order, as a block manager hands them out
    for i, n in enumerate(lens):
        for j in range((n + block_size - 1) // block_size):
            tables[i, j] = free.pop()
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lens,heads,kv_heads,head_dim,block_size",
    [
        ([1, 5, 33], 4, 4, 64, 16),  # no GQA
        ([17, 64, 65, 200], 9, 3, 64, 16),  # SmolLM2's heads, contexts across block edges
        ([300, 2], 8, 2, 128, 256),  # Qwen3's head_dim, one long context
        ([40], 4, 1, 256, 32),  # one KV head for all
        ([9, 30], 4, 2, 16, 8),  # a head_dim of no compiled specialisation (the tests' tiny models)
    ],
)
def test_paged_decode_matches_torch(dtype, lens, heads, kv_heads, head_dim, block_size):
    q, k_cache, v_cache, context_lens, tables = paged_inputs(dtype, lens, heads, kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    want = torch_attention.paged_decode_attention(q, k_cache, v_cache, context_lens, tables, scale)
    got = cpu_ops.paged_decode(q, k_cache, v_cache, context_lens, tables, scale)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]  # one rounding of the output
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_paged_decode_rejects_bad_tables_and_shapes():
    q, k_cache, v_cache, context_lens, tables = paged_inputs(torch.float32, [20, 3], 4, 2, 64, 16)
    bad = tables.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match="block table points outside the cache"):
        cpu_ops.paged_decode(q, k_cache, v_cache, context_lens, bad, 0.125)
    with pytest.raises(ValueError, match="longer than the block table covers"):
        cpu_ops.paged_decode(q, k_cache, v_cache, torch.tensor([20, 100], dtype=torch.int32), tables, 0.125)
    with pytest.raises(ValueError, match="with that head_dim"):
        cpu_ops.paged_decode(q[..., :32].contiguous(), k_cache, v_cache, context_lens, tables, 0.125)
    with pytest.raises(ValueError, match="must have one dtype"):
        cpu_ops.paged_decode(q.bfloat16(), k_cache, v_cache, context_lens, tables, 0.125)


def test_layers_take_the_cpp_path_on_cpu_and_the_option_turns_it_off():
    torch.manual_seed(0)
    x, r = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    gate_up = torch.randn(5, 2 * 48).bfloat16()
    q, k = torch.randn(5, 4, 64).bfloat16(), torch.randn(5, 2, 64).bfloat16()
    positions, weight = torch.arange(5), torch.empty(64).uniform_(0.5, 1.5).bfloat16()

    def layers(table):
        """A norm, an activation, a RoPE and an attention layer built with the kernel table `table`."""
        norm = layernorm.RMSNorm(64, ops=table).to(torch.bfloat16)
        norm.weight.data.copy_(weight)
        rope = rotary_embedding.RotaryEmbedding(64, 64, 64, 10000.0, ops=table)
        return norm, activation.SiluAndMul(ops=table), rope, attention.Attention(4, 64, 0.125, 2, ops=table)

    table = pick("cpu")
    assert table.rms_norm is cpu_ops.rms_norm and table.paged_decode is cpu_ops.checked_paged_decode
    norm, act, rope, attn = layers(table)
    assert torch.equal(norm(x), cpu_ops.rms_norm(x, norm.weight, norm.eps))
    assert all(torch.equal(a, b) for a, b in zip(norm(x, r), cpu_ops.add_rms_norm(x, r, norm.weight, norm.eps)))
    assert torch.equal(act(gate_up), cpu_ops.silu_and_mul(gate_up))
    rotated = rope(positions, q, k)
    assert all(torch.equal(a, b) for a, b in zip(rotated, cpu_ops.rotary(positions, q, k, rope.cos_sin_cache)))
    assert attn.store is cpu_ops.store_kvcache
    off = pick("cpu", options=KernelOptions(cpu_ops=False))
    assert off.rms_norm is None and off.paged_decode is None and off.store_kvcache is None
    norm, act, rope, attn = layers(off)
    assert torch.equal(norm(x), layernorm.rms_norm(x, norm.weight, norm.eps))  # the torch definition
    assert torch.equal(act(gate_up), activation.silu_and_mul(gate_up))
    assert attn.store is attention.store_kvcache_torch
    assert attention_backends.create("torch", decode=table.paged_decode).decode is cpu_ops.checked_paged_decode
    args = paged_inputs(torch.bfloat16, [30, 7], 4, 2, 64, 16)
    torch.testing.assert_close(
        cpu_ops.paged_decode(*args, 0.125).float(),
        attention_backends.create("torch").decode(*args, 0.125).float(),
        atol=1e-2,
        rtol=1e-2,
    )


def test_engine_tokens_equal_with_and_without_the_cpp_ops(tiny_qwen3, tiny_llama):
    """fp32 greedy tokens through the whole engine (prefill, decode, chunked prefill beside decoding sequences),
    the C++ operators against the torch ones."""
    prompts = [[(5 * i + n) % 300 + 3 for i in range(n)] for n in (3, 20, 41, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for model in (tiny_qwen3, tiny_llama):
        tokens = {}
        for on in (True, False):
            kw = dict(dtype="float32", max_num_batched_tokens=32, max_model_len=128, device="cpu")
            llm = LLM(model, **kw, kernels=dict(cpu_ops=on))
            assert llm.model_runner.ops.name == ("c++" if on else "torch")
            tokens[on] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            llm.exit()
        assert tokens[True] == tokens[False]


def test_without_a_build_the_engine_runs_the_torch_ops(tmp_path, monkeypatch, caplog):
    """No library for this machine's key: not loaded, the reason says how to build it, the layers run torch."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_ops, "_state", {})
    assert not cpu_ops.loaded()
    assert "python3 -m minivllm.kernels.cpu.build" in cpu_ops.not_loaded_reason()
    with caplog.at_level(logging.INFO, logger="minivllm.kernels.cpu.ops"):
        cpu_ops.log_choice(True)
    assert "CPU ops: torch; the C++ library is not built" in caplog.text
    assert pick("cpu") == pick("cpu", options=KernelOptions(cpu_ops=False))  # the torch definitions


def test_the_library_key_follows_the_source(tmp_path, monkeypatch):
    source = tmp_path / "cpu_ops.cpp"
    source.write_text("// one\n")
    monkeypatch.setattr(build, "SOURCES", [str(source)])
    first = build.library_path()
    source.write_text("// two\n")
    assert build.library_path() != first  # an edited source is a new build, never a stale library


def test_this_machines_build_passes_the_self_test_in_a_fresh_process():
    """The self-test a new build must pass (setup.sh's build, a fresh machine's) runs against today's torch
    definitions: one that no longer does rejects every build, and every fresh machine runs the torch ops."""
    test = [sys.executable, "-m", "minivllm.kernels.cpu.self_test", build.library_path()]
    done = subprocess.run(test, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]


def test_an_edited_self_test_is_a_new_build(tmp_path, monkeypatch):
    test = tmp_path / "self_test.py"
    test.write_text("# one\n")
    monkeypatch.setattr(build, "SELF_TEST", str(test))
    first = build.library_path()
    test.write_text("# two\n")
    assert build.library_path() != first


def test_a_compiler_whose_build_fails_or_fails_its_self_test_is_passed_over(tmp_path, monkeypatch):
    """$CXX first; a compile that fails, and a library that does not pass the self-test in a fresh process, are
    reported with the compiler's name and never installed."""
    broken = tmp_path / "broken-cxx"
    broken.write_text("#!/bin/sh\necho 'no such compiler' >&2\nexit 1\n")
    fake = tmp_path / "fake-cxx"  # "builds" a file that is no library
    fake.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho junk > "$2"\n')
    for script in (broken, fake):
        script.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    assert build.compilers()[0] == str(broken) and len(set(build.compilers())) == len(build.compilers())
    assert "no such compiler" in build._compile_and_check(str(broken), str(tmp_path / "a.so"), verbose=False)
    failure = build._compile_and_check(str(fake), str(tmp_path / "b.so"), verbose=False)
    assert failure is not None and "failed the self-test" in failure
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "compilers", lambda: [str(broken), str(fake)])
    with pytest.raises(RuntimeError, match="no compiler built CPU ops that pass their self-test"):
        build.build()
    assert not (tmp_path / "cache" / "cpu_ops").exists() or not list((tmp_path / "cache" / "cpu_ops").rglob("*.so"))
