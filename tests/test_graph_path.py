"""The decode-graph data path on CPU (minivllm/engine/cuda_graphs.py, step_inputs.py DecodeLayout): CUDA graphs
cannot be captured without a GPU, but everything around them can run. Here the "graph" of each batch size
runs its captured step eagerly at every replay, so a CPU engine goes through what a GPU engine with graphs
does: batches padded to a captured size, inputs uploaded at the fixed offsets the graphs read, the previous
step's tokens fed on the device, and (with the Triton kernels through the interpreter) the whole step
including the sampler's race inside the "graph". Tokens must equal the plain eager engine's."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine import warmup
from minivllm.engine.cuda_graphs import DecodeGraphs, PrefillGraphs, prefill_graph_rows
from minivllm.engine.step_inputs import InputBuffers, PrefillLayout
from minivllm.utils import switches


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
    r.graphs.capture(r.decode_step)
    return llm


PROMPTS = [[(7 * i + n) % 500 + 1 for i in range(n)] for n in (1, 5, 17, 40, 90)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.slow
def test_graph_path_greedy_tokens_equal_eager(tiny_qwen3):
    eager = LLM(tiny_qwen3, kvcache_block_size=16, max_num_seqs=8)
    expected = [o.token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]
    eager.exit()
    with switches.override(triton_on_cpu=True):  # the sampler's Triton race inside the "graph"
        llm = graph_engine(tiny_qwen3)
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
    with switches.override(triton_on_cpu=True):
        llm = graph_engine(tiny_qwen3)
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


# --- the prefill graphs' data path (cuda_graphs.PrefillGraphs), on CPU ---------------------------------------


class EagerPrefillGraphs(PrefillGraphs):
    """Replaying a sequence count runs the captured step function eagerly; counts 2, 4, 8 to see the padding."""

    def capture(self, step) -> None:
        self.row_counts = [2, 4, 8]
        self.step, self.graphs, self.replayed = step, dict.fromkeys(self.row_counts), []

    def replay(self, rows: int) -> None:
        self.replayed.append(rows)
        self.step(rows)


def prefill_graph_engine(path: str, budget: int) -> LLM:
    """A CPU engine whose prefill steps of exactly `budget` tokens take the prefill-graph path: inputs padded and
    uploaded at the prefill layout's offsets, every row through the prefill attention over the cache."""
    llm = LLM(path, kvcache_block_size=16, max_num_seqs=8, max_num_batched_tokens=budget)
    r = llm.model_runner
    r.prefill_keys_from_cache = True  # what FlashAttention-4 engines do; the torch backend can too
    layout = PrefillLayout(max_tokens=budget, max_seqs=8, max_blocks=r.max_num_blocks)
    r.buffers = InputBuffers(max_tokens=budget, layout=r.buffers.layout, device=r.device, prefill_layout=layout)
    hidden = llm.config.hf_config.hidden_size
    r.prefill_graphs = EagerPrefillGraphs(
        tokens=budget, max_num_seqs=8, hidden_size=hidden, dtype=r.dtype, device=r.device
    )
    warmup.prefill_graph_stand_in(r)
    r.prefill_graphs.capture(r.prefill_step)
    return llm


@pytest.mark.slow
def test_prefill_graph_path_tokens_equal_eager(tiny_qwen3):
    """Chunked prompts beside decoding sequences fill a 48-token budget: those steps run the prefill graph's
    step (one to six sequences padded to 2, 4 or 8; decode rows in the prefill attention; the previous step's
    tokens fed into the fixed input buffer), the others eagerly. Tokens must equal the plain eager engine's."""
    prompts = [[(7 * i + n) % 500 + 1 for i in range(n)] for n in (60, 3, 30, 70, 100, 9)]
    eager = LLM(tiny_qwen3, kvcache_block_size=16, max_num_seqs=8, max_num_batched_tokens=48)
    expected = [o.token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    eager.exit()
    llm = prefill_graph_engine(tiny_qwen3, budget=48)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    graphs = llm.model_runner.prefill_graphs
    llm.exit()
    assert got == expected
    assert len(graphs.replayed) >= 3 and set(graphs.replayed) <= {2, 4, 8}
    assert len(set(graphs.replayed)) >= 2  # padded to more than one count


def test_pad_prefill_adds_sequences_that_read_and_write_nothing():
    import numpy as np

    from minivllm.engine.sequence import Sequence
    from minivllm.engine.step_inputs import pad_prefill, prepare_prefill

    a, b = Sequence([1, 2, 3]), Sequence(list(range(1, 21)))
    a.block_table, b.block_table = [5], [2, 7]
    a.num_scheduled_tokens, b.num_scheduled_tokens = 3, 20
    inp = prepare_prefill([a, b], 16, keys_from_cache=True)
    padded = pad_prefill(inp, rows=4, table_width=3)
    assert padded.cu_seqlens_q.tolist() == [0, 3, 23, 23, 23]  # no queries past the step's
    assert padded.context_lens.tolist() == [3, 20, 0, 0]  # no keys
    assert padded.block_tables.tolist() == [[5, -1, -1], [2, 7, -1], [-1, -1, -1], [-1, -1, -1]]
    assert np.array_equal(padded.slot_mapping, inp.slot_mapping) and padded.num_seqs == 2
    with pytest.raises(ValueError, match="more than 1 x 3"):
        pad_prefill(inp, rows=1, table_width=3)
    inp.block_tables = None
    with pytest.raises(ValueError, match="block tables"):
        pad_prefill(inp, rows=4, table_width=3)


def test_prefill_layout_is_one_set_of_disjoint_aligned_views():
    import torch

    layout = PrefillLayout(max_tokens=10, max_seqs=3, max_blocks=2)
    buffer = torch.arange(layout.size, dtype=torch.int32)
    views = layout.views(buffer)
    assert list(views) == [
        "input_ids",
        "positions",
        "slot_mapping",
        "src",
        "context_lens",
        "cu_seqlens_q",
        "block_tables",
    ]
    assert views["block_tables"].shape == (3, 2) and views["cu_seqlens_q"].shape == (4,)
    covered = torch.cat([v.flatten() for v in views.values()]).tolist()
    assert len(set(covered)) == len(covered) == 4 * 10 + 3 + 4 + 6
    assert all(v.data_ptr() % 16 == 0 for v in views.values())


def test_prefill_graph_rows_are_multiples_of_64_up_to_the_limit():
    assert prefill_graph_rows(8) == [8]
    assert prefill_graph_rows(64) == [64]
    assert prefill_graph_rows(200) == [64, 128, 192, 200]
    assert prefill_graph_rows(512)[-1] == 512 and len(prefill_graph_rows(512)) == 8


# --- on a GPU: the prefill graphs themselves --------------------------------------------------------------


def chunk_step(llm: LLM, prompts: list[list[int]], scheduled: list[int], computed: list[int]):
    """A prefill step by hand: sequence i has computed[i] tokens in the cache and schedules scheduled[i] more,
    each with blocks of its own (the cache is otherwise unused)."""
    from minivllm.engine.sequence import Sequence

    r, seqs, next_block = llm.model_runner, [], 0
    for i, (p, n, c) in enumerate(zip(prompts, scheduled, computed)):
        s = Sequence(p)
        blocks = -(-(c + n) // r.block_size)
        s.block_table, next_block = list(range(next_block, next_block + blocks)), next_block + blocks
        s.num_computed_tokens, s.num_scheduled_tokens, s.sample_row = c, n, i
        seqs.append(s)
    return r.prepare_prefill(seqs)


@pytest.mark.gpu
def test_gpu_prefill_graph_logits_equal_the_eager_step(gpu_bf16_qwen3):
    """bf16 with FlashAttention-4 on the GPU, a 256-token budget: a step of three fresh prompts that fills it
    replays a graph and gives the eager step's logits bit for bit (the same kernels on the same rows; only
    the attention's grid is padded). A step of decode rows beside a chunk: the graph attends the decode rows in
    the prefill kernel, the eager step in the decode kernel: equal to bf16's rounding, the same argmax."""
    import torch

    kw = dict(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=100, num_kvcache_blocks=64)
    llm = LLM(gpu_bf16_qwen3, dtype="bfloat16", **kw)
    r = llm.model_runner
    assert sorted(r.prefill_graphs.graphs) == [64, 100]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 500, (n,), generator=gen).tolist() for n in (100, 120, 36, 300)]

    def both(inp):
        graphs = r.prefill_graphs
        replays = graphs.replays
        with_graph = r.run_model(inp).float()
        assert graphs.replays == replays + 1
        r.prefill_graphs = None
        try:
            eager = r.run_model(inp).float()
        finally:
            r.prefill_graphs = graphs
        return with_graph, eager

    g, e = both(chunk_step(llm, prompts[:3], [100, 120, 36], [0, 0, 0]))
    assert g.shape == e.shape == (3, llm.config.hf_config.vocab_size) and torch.equal(g, e)
    # the first three decode one token each (their prompts are in the cache now), the fourth's first chunk
    decode_and_chunk = chunk_step(llm, [p + [7] for p in prompts[:3]] + prompts[3:], [1, 1, 1, 253], [100, 120, 36, 0])
    assert decode_and_chunk.num_decode_rows == 3
    g, e = both(decode_and_chunk)
    assert g.shape == e.shape == (4, llm.config.hf_config.vocab_size)
    assert (g - e).abs().max() <= 0.05 * e.abs().max(), (g - e).abs().max()
    assert torch.equal(g.argmax(-1), e.argmax(-1))
    llm.exit()


@pytest.mark.gpu
def test_gpu_prefill_graphs_follow_the_switch_and_the_backend(gpu_bf16_qwen3):
    """MINIVLLM_PREFILL_GRAPH=0 (what benchmarks compare against), enforce_eager, and fp32 (no FlashAttention-4)
    capture none; the default engine replays one for each full 256-token step of a chunked workload."""
    prompts = [[(13 * i + n) % 500 + 1 for i in range(n)] for n in (300, 40, 700)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(max_model_len=1024, max_num_batched_tokens=256, num_kvcache_blocks=64, dtype="bfloat16")
    llm = LLM(gpu_bf16_qwen3, **kw)
    assert llm.model_runner.prefill_graphs is not None
    llm.generate(prompts, greedy, use_tqdm=False)
    assert llm.model_runner.prefill_graphs.replays >= 3
    llm.exit()
    with switches.override(prefill_graph=False):
        llm = LLM(gpu_bf16_qwen3, **kw)
        assert llm.model_runner.prefill_graphs is None and llm.model_runner.graphs is not None
        llm.exit()
    for other in (dict(enforce_eager=True), dict(dtype="float32")):
        llm = LLM(gpu_bf16_qwen3, **{**kw, **other})
        assert llm.model_runner.prefill_graphs is None
        llm.exit()
