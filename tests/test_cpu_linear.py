"""Linear layers on CPU through oneDNN with packed weights (minivllm/kernels/cpu/linear.py): the same numbers as
F.linear (up to the order of fp32 sums), for every layer of the Linear family and the LM head, with and without
bias, any number of rows; an engine on CPU packs its layers, and the switch turns it off."""

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close
from minivllm import LLM, SamplingParams
from minivllm.kernels import KernelOptions, pick
from minivllm.kernels.cpu import linear as cpu_linear
from minivllm.layers.embed_head import ParallelLMHead
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from minivllm.utils.context import reset_context

pytestmark = pytest.mark.skipif(not cpu_linear.packable(torch.zeros(2, 2)), reason="no oneDNN in this torch build")


CPU = pick("cpu")  # a CPU engine's kernels: the packed linear among them


def _layers(dtype):
    torch.manual_seed(0)
    layers = {
        "replicated+bias": ReplicatedLinear(48, 40, bias=True, ops=CPU),
        "qkv+bias": QKVParallelLinear(48, 16, 4, 2, bias=True, ops=CPU),
        "merged": MergedColumnParallelLinear(48, [64, 64], ops=CPU),
        "row+bias": RowParallelLinear(48, 24, bias=True, ops=CPU),
    }
    for m in layers.values():
        for p in m.parameters():
            p.data.normal_()
    return {k: m.to(dtype) for k, m in layers.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 300])
def test_packed_layers_equal_f_linear(dtype, rows):
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    for name, m in _layers(dtype).items():
        x = torch.randn(rows, 48).to(dtype)
        want = F.linear(x, m.weight, m.bias)
        packs = dtype != torch.bfloat16 or cpu_linear.bf16_supported()  # else bf16 keeps F.linear
        assert m.pack_weight() == packs, name
        got = m(x)
        assert got.shape == want.shape and got.dtype == dtype, name
        assert_close(got, want, **tol)
        packed, m.packed_weight = m.packed_weight, None  # not packed (the cpu_packed_linear option): F.linear itself
        assert torch.equal(m(x), want), name
        m.packed_weight = packed


def test_packed_lm_head_equals_f_linear():
    torch.manual_seed(0)
    head = ParallelLMHead(500, 32, ops=CPU)
    head.weight.data.normal_()
    reset_context()  # decode: every row is a last token
    x = torch.randn(5, 32)
    want = F.linear(x, head.weight)
    assert head.pack_weight()
    assert_close(head(x), want, atol=1e-4, rtol=1e-4)


def test_only_a_table_with_the_packed_linear_packs():
    """A layer built alone (the torch definitions) or with the option off packs nothing and runs F.linear."""
    off = pick("cpu", options=KernelOptions(cpu_packed_linear=False))
    assert CPU.linear is cpu_linear.linear and off.linear is None and off.pack_linear is None
    for table in (None, off):
        m = ReplicatedLinear(8, 4) if table is None else ReplicatedLinear(8, 4, ops=table)
        m.weight.data.normal_()
        assert not m.pack_weight() and m.packed_weight is None
        x = torch.randn(2, 8)
        assert torch.equal(m(x), F.linear(x, m.weight))


def test_unpackable_weights_fall_back_to_f_linear():
    m = ReplicatedLinear(8, 4, ops=CPU)
    m.weight.data.normal_()  # (torch.empty otherwise: NaNs now and then, and NaN != NaN)
    m = m.to(torch.float16)  # oneDNN's CPU matmul: fp32 and bf16 here
    assert not m.pack_weight() and m.packed_weight is None
    x = torch.randn(2, 8).to(torch.float16)
    assert torch.equal(m(x), F.linear(x, m.weight))


def test_engine_on_cpu_packs_its_layers_and_answers_the_same_without(tiny_qwen3):
    kw = dict(device="cpu", num_kvcache_blocks=16, kvcache_block_size=16, max_model_len=128)
    llm, unpacked = LLM(tiny_qwen3, **kw), LLM(tiny_qwen3, **kw, kernels=dict(cpu_packed_linear=False))
    for engine, want in ((llm, 2 * 4 + 1), (unpacked, 0)):  # 2 layers x (qkv, o, gate_up, down) + the LM head
        model = engine.model_runner.model
        assert len([m for m in model.modules() if getattr(m, "packed_weight", None) is not None]) == want
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 2, 3], list(range(5, 40))]

    def generate(engine) -> tuple[list[list[int]], int]:
        """The tokens, and how many matmuls went through the packed weights (oneDNN's op, seen by the profiler)."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            tokens = [o.token_ids for o in engine.generate(prompts, greedy, use_tqdm=False)]
        return tokens, sum(e.name == "mkldnn::_linear_pointwise" for e in prof.events())

    with_packing, packed_calls = generate(llm)
    without, calls_without = generate(unpacked)
    assert packed_calls >= 8 * 9 and calls_without == 0  # every matmul of every step, or none
    assert with_packing == without
    llm.exit()
    unpacked.exit()
