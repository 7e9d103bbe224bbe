"""CUDA graphs for decode steps (nano-vllm's capture_cudagraph; notebook 13).

A decode step of a small model is hundreds of short kernels, and launching them one by one from Python
costs more than running them. A CUDA graph records the launches once per batch size and replays them with
one call. A graph reads its inputs from fixed addresses, so every decode input lives in one persistent
device buffer (`step_inputs.DecodeLayout`) that the runner refreshes before each replay; a batch is padded
up to the next captured size (padding rows write nothing and attend to nothing). Graphs share one memory
pool, captured largest first so the smaller ones fit in its blocks."""

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
