"""The decode graphs' L2 prefetch (minivllm/layers/l2_prefetch.py): each linear layer prefetches the weight of
the one that runs after it, in the order a step runs them; the prefetch refuses what it cannot take; on a GPU a
step captured with it gives exactly the tokens of one captured without it (a prefetch only moves bytes into L2)."""

import pytest
import torch

from minivllm.layers.l2_prefetch import StepPrefetch, prefetch, supported
from minivllm.layers.linear import LinearBase
from minivllm.utils import switches

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_each_linear_prefetches_the_next_one_a_step_runs(tiny_qwen3):
    from minivllm import LLM, SamplingParams

    llm = LLM(tiny_qwen3, device="cpu", max_model_len=64)
    model = llm.model_runner.model
    run = []  # the linear layers in the order a forward calls them
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    hooks = [m.register_forward_pre_hook(lambda m, a: run.append(m)) for m in linears]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)
    for h in hooks:
        h.remove()
    llm.exit()
    layers = llm.config.hf_config.num_hidden_layers
    assert len(run) == 4 * layers and len(set(run)) == 4 * layers  # qkv, o, gate/up, down of each layer, once
    pairs = StepPrefetch(model, LinearBase).pairs
    assert [(layer, w.data_ptr()) for layer, w in pairs] == [(a, b.weight.data_ptr()) for a, b in zip(run, run[1:])]
    two = StepPrefetch(model, LinearBase, ahead=2).pairs
    assert [w.data_ptr() for _, w in two] == [b.weight.data_ptr() for b in run[2:]]


def test_prefetch_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="contiguous CUDA tensor"):
        prefetch(torch.zeros(16))
    assert not supported(torch.device("cpu"))


def test_the_switch_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("MINIVLLM_L2_PREFETCH", "1")
    assert switches.from_env().l2_prefetch is True
    monkeypatch.setenv("MINIVLLM_L2_PREFETCH", "2")
    with pytest.raises(ValueError, match="MINIVLLM_L2_PREFETCH must be 0 or 1"):
        switches.from_env()


@pytest.mark.gpu
@gpu
def test_gpu_prefetch_runs_in_a_graph_and_leaves_data_alone():
    if not supported(torch.device("cuda")):
        pytest.skip("bulk prefetch needs Hopper or later")
    w = torch.randn(3000, 1024, device="cuda", dtype=torch.bfloat16)  # not a multiple of the chunk
    before = w.clone()
    side = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.graph(g):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefetch(w)
        y = x @ w.T
        main.wait_stream(side)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, before) and torch.equal(y, x @ w.T)


@pytest.mark.gpu
@gpu
def test_gpu_engine_tokens_with_and_without_l2_prefetch(tiny_qwen3):
    from minivllm import LLM, SamplingParams

    prompts = [[(7 * i + n) % 500 for i in range(n)] for n in (5, 40, 1, 90)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for on in (True, False):
        with switches.override(l2_prefetch=on):
            llm = LLM(tiny_qwen3, device="cuda", dtype="bfloat16", max_model_len=256)
            assert (llm.model_runner.step_prefetch is not None) == (on and supported(torch.device("cuda")))
            runs[on] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            llm.exit()
    assert runs[True] == runs[False]
