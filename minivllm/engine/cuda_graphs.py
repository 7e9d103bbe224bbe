"""CUDA graphs for decode steps (nano-vllm's capture_cudagraph; notebook 13).

A decode step of a small model is hundreds of short kernels, and launching them one by one from Python costs more than
running them. A CUDA graph records the launches once per batch size and replays them with one call. A graph reads its
inputs from fixed addresses, so every decode input lives in one persistent device buffer (`step_inputs.DecodeLayout`)
that the runner refreshes before each replay; a batch is padded up to the next captured size (padding rows write nothing
and attend to nothing). Graphs share one memory pool, captured largest first so the smaller ones fit in its blocks."""

from collections.abc import Callable, Hashable

import torch

from minivllm import kernels
from minivllm.utils.context import reset_context, set_context


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then every multiple of 16, up to max_num_seqs."""
    return [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


class DecodeGraphs:
    """One captured graph per batch size; `outputs` holds the hidden states of the last replay."""

    def __init__(self, *, max_num_seqs: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.outputs = torch.zeros(max_num_seqs, hidden_size, dtype=dtype, device=device)  # (S, hidden)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def padded(self, bs: int) -> int:
        """The captured batch size a batch of `bs` sequences runs in."""
        return next(b for b in self.batch_sizes if b >= bs)

    @torch.inference_mode()
    def capture(self, step: Callable[[int], None], variant: Callable[[int], Hashable] = lambda bs: bs) -> None:
        """Capture `step(bs)` (which reads the decode buffer and writes `outputs[:bs]`) for every batch size.
        A size first runs `step` eagerly (kernels compile there, not inside the capture) only when `variant(bs)`
        is new: sizes with the same variant launch the same compiled kernels (the default warms up every size)."""
        pool, seen = None, set()
        for bs in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            if (key := variant(bs)) not in seen:
                step(bs)  # warm-up: compile, autotune, allocate outside the graph
                seen.add(key)
            with torch.cuda.graph(graph, pool):
                step(bs)
            pool = pool or graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def replay(self, bs: int) -> None:
        self.graphs[bs].replay()


def capture(runner) -> DecodeGraphs:
    """The decode graphs of the engine's ModelRunner `runner`: `decode_step` captured for every batch size."""
    hf = runner.config.hf_config
    graphs = runner.graphs = DecodeGraphs(
        max_num_seqs=runner.config.max_num_seqs, hidden_size=hf.hidden_size, dtype=runner.dtype, device=runner.device
    )
    runner.buffers.clear_decode()
    # only the first size of each kernel variant runs an eager warm-up before its capture
    kv_heads = runner.attn_layers[0].num_kv_heads  # this rank's, as the decode kernel sees them
    graphs.capture(lambda bs: decode_step(runner, bs), variant=lambda bs: kernels.decode_graph_variant(bs, kv_heads))
    return graphs


def decode_step(runner, bs: int) -> None:
    """What the decode graph of batch `bs` runs, reading the runner's decode buffer. With one GPU the whole step:
    feed the previous step's tokens, the model, the LM head, the sampler (its tokens land in `last_sampled`)."""
    v, graphs = runner.buffers.decode, runner.graphs
    # a fresh context per capture: what the layers derive from it (the page table) is made inside the graph
    set_context(
        False,
        slot_mapping=v["slot_mapping"][:bs],
        context_lens=v["context_lens"][:bs],
        block_tables=v["block_tables"][:bs],
    )
    if runner.sample_in_graph:
        runner.feed_pending(v["input_ids"][:bs], v["src"][:bs])
    graphs.outputs[:bs] = runner.model(v["input_ids"][:bs], v["positions"][:bs])
    if runner.sample_in_graph:
        logits = runner.model.compute_logits(graphs.outputs[:bs])  # (bs, vocab)
        runner.sampler.draw_kernels(logits, runner.buffers.temperatures[:bs], out=runner.last_sampled[:bs])
    reset_context()


def replay(runner, inp, need_logits: bool) -> torch.Tensor | None:
    """A decode step of `runner` (a StepInput) by its graph: the logits of its sequences, or None when the graph
    sampled and they are not needed (its tokens are in `runner.last_sampled`)."""
    t = runner.buffers.upload_step(inp, at_layout=True)
    if inp.src is not None and not runner.sample_in_graph:
        runner.feed_pending(t["input_ids"], t["src"])
    runner.graphs.replay(inp.input_ids.shape[0])
    if runner.sample_in_graph and not need_logits:
        return None
    return runner.model.compute_logits(runner.graphs.outputs[: inp.num_seqs])
