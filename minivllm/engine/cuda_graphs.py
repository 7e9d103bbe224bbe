"""CUDA graphs for decode steps (nano-vllm's capture_cudagraph; notebook 13), and for prefill steps that fill
the token budget.

A decode step of a small model is hundreds of short kernels, and launching them one by one from Python
costs more than running them. A CUDA graph records the launches once per batch size and replays them with
one call. A graph reads its inputs from fixed addresses, so every decode input lives in one persistent
device buffer (`step_inputs.DecodeLayout`) that the runner refreshes before each replay; a batch is padded
up to the next captured size (padding rows write nothing and attend to nothing). Graphs share one memory
pool, captured largest first so the smaller ones fit in its blocks.

A prefill step of 16,384 tokens keeps the GPU busy for ~25 ms, yet launching its ~400 kernels one by one took
the host about as long (benchmarks/NOTES.md, part IV): under load, when chunked prefill fills the token
budget, the GPU waited on Python. `PrefillGraphs` captures the whole forward of a step of exactly that many
tokens, attention included (FlashAttention-4 reads the step's lengths from the device, and its grid depends
only on the token and sequence counts), once per padded sequence count. Steps of other sizes run eagerly."""

from collections.abc import Callable, Hashable

import torch


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
    def capture(
        self, step: Callable[[int], None], variant: Callable[[int], Hashable] = lambda bs: bs, pool=None
    ) -> None:
        """Capture `step(bs)` (which reads the decode buffer and writes `outputs[:bs]`) for every batch size.
        A size first runs `step` eagerly (kernels compile there, not inside the capture) only when `variant(bs)`
        is new: sizes with the same variant launch the same compiled kernels (the default warms up every size).
        `pool`: a memory pool to share (the prefill graphs')."""
        seen = set()
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


def prefill_graph_rows(max_num_seqs: int) -> list[int]:
    """The sequence counts prefill graphs are captured for: every multiple of 64, up to max_num_seqs. A step is
    padded to the next one; FlashAttention-4's varlen grid has a program per (tile of 128 rows + one per
    sequence) and head, most of them empty, so padding to max_num_seqs alone would add thousands."""
    return list(range(64, max_num_seqs, 64)) + [max_num_seqs]


class PrefillGraphs:
    """One captured graph per padded sequence count of a prefill step of exactly `tokens` tokens; `outputs`
    holds the hidden states of the last replay (the LM head runs after it, on each sequence's last token)."""

    def __init__(
        self, *, tokens: int, max_num_seqs: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.tokens = tokens
        self.row_counts = prefill_graph_rows(max_num_seqs)
        self.outputs = torch.zeros(tokens, hidden_size, dtype=dtype, device=device)  # (T, hidden)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps that ran here (tests and benchmarks read it)

    def fits(self, num_tokens: int) -> bool:
        return num_tokens == self.tokens

    def padded(self, num_seqs: int) -> int:
        """The captured sequence count a step of `num_seqs` sequences runs in."""
        return next(r for r in self.row_counts if r >= num_seqs)

    @torch.inference_mode()
    def capture(self, step: Callable[[int], None]):
        """Capture `step(rows)` (which reads the prefill buffer and writes `outputs`) for every sequence count,
        the largest first; returns the memory pool, for the decode graphs to share. Every count launches the
        same kernels, so only the first runs `step` eagerly before its capture."""
        pool = None
        for i, rows in enumerate(reversed(self.row_counts)):
            if i == 0:
                step(rows)  # warm-up: compile, allocate outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                step(rows)
            pool = pool or graph.pool()
            self.graphs[rows] = graph
            torch.cuda.synchronize()
        return pool

    def replay(self, rows: int) -> None:
        self.graphs[rows].replay()
        self.replays += 1
