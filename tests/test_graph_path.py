"""The decode-graph data path on CPU (minivllm/engine/cuda_graphs.py, step_inputs.py DecodeLayout): CUDA graphs
cannot be captured without a GPU, but everything around them can run. Here the "graph" of each batch size
runs its captured step eagerly at every replay, so a CPU engine goes through what a GPU engine with graphs
does: batches padded to a captured size, inputs uploaded at the fixed offsets the graphs read, the previous
step's tokens fed on the device, and (with the Triton kernels through the interpreter) the whole step
including the sampler's race inside the "graph". Tokens must equal the plain eager engine's."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.cuda_graphs import DecodeGraphs, decode_step


class EagerGraphs(DecodeGraphs):
    """Replaying a batch size runs the captured step function eagerly (what the graph would launch)."""

    def capture(self, step) -> None:
        self.step = step
        self.graphs = dict.fromkeys(self.batch_sizes)
        self.replayed: list[int] = []

    def replay(self, bs: int) -> None:
        self.replayed.append(bs)
        self.step(bs)


def graph_engine(path: str, **kwargs) -> LLM:
    """A CPU engine switched to the graph path after start-up (capture never ran on CPU)."""
    llm = LLM(path, kvcache_block_size=16, max_num_seqs=8, **kwargs)
    r = llm.model_runner
    r.enforce_eager, r.sample_in_graph = False, True
    hidden = llm.config.hf_config.hidden_size
    r.graphs = EagerGraphs(max_num_seqs=8, hidden_size=hidden, dtype=r.dtype, device=r.device)
    r.buffers.clear_decode()
    r.graphs.capture(lambda bs: decode_step(r, bs))
    return llm


PROMPTS = [[(7 * i + n) % 500 + 1 for i in range(n)] for n in (1, 5, 17, 40, 90)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.slow
def test_graph_path_greedy_tokens_equal_eager(tiny_qwen3):
    eager = LLM(tiny_qwen3, kvcache_block_size=16, max_num_seqs=8)
    expected = [o.token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]
    eager.exit()
    llm = graph_engine(tiny_qwen3, kernels=dict(triton_on_cpu=True))  # the sampler's Triton draw in the "graph"
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    graphs = llm.model_runner.graphs
    llm.exit()
    assert got == expected
    assert graphs.replayed and set(graphs.replayed) <= {1, 2, 4, 8}  # padded to captured sizes
    assert 8 in graphs.replayed  # five sequences decode in the graph of eight: three padding rows


@pytest.mark.slow
def test_graph_path_mixed_batch_keeps_greedy_rows(tiny_qwen3):
    """A top-k row sends the batch's sampling outside the graph (the graph's draw is discarded): the greedy rows
    must still get their argmax, the sampled rows their full lengths."""
    eager = LLM(tiny_qwen3, kvcache_block_size=16, max_num_seqs=8)
    expected = [o.token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]
    eager.exit()
    sampled = SamplingParams(temperature=1.0, top_k=5, max_tokens=12, ignore_eos=True)
    llm = graph_engine(tiny_qwen3, kernels=dict(triton_on_cpu=True))
    out = llm.generate(PROMPTS, [GREEDY, sampled, GREEDY, sampled, GREEDY], use_tqdm=False)
    llm.exit()
    assert [out[i].token_ids for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]
    assert [len(out[i].token_ids) for i in (1, 3)] == [12, 12]


def test_capture_warms_up_only_the_first_size_of_each_variant(monkeypatch):
    """DecodeGraphs.capture runs the step eagerly before capturing a size only when the size's variant is new
    (largest size first); every size is captured once. Capture itself is faked here (no GPU)."""
    import contextlib

    import torch

    class FakeGraph:
        def pool(self):
            return "pool"

    capturing = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    @contextlib.contextmanager
    def graph(g, pool=None):
        capturing.append(True)
        yield
        capturing.pop()

    monkeypatch.setattr(torch.cuda, "graph", graph)
    calls = []
    graphs = DecodeGraphs(max_num_seqs=64, hidden_size=1, dtype=torch.float32, device=torch.device("cpu"))
    graphs.capture(lambda bs: calls.append((bs, bool(capturing))), variant=lambda bs: (bs <= 8, bs == 1))
    warmed = [bs for bs, in_capture in calls if not in_capture]
    captured = [bs for bs, in_capture in calls if in_capture]
    assert captured == [64, 48, 32, 16, 8, 4, 2, 1]  # largest first, each once
    assert warmed == [64, 8, 1]  # the first size of each variant
    calls.clear()
    graphs.capture(lambda bs: calls.append((bs, bool(capturing))))  # default: every size warms up
    assert [bs for bs, c in calls if not c] == [bs for bs, c in calls if c] == [64, 48, 32, 16, 8, 4, 2, 1]
