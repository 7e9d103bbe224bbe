"""What the tensor-parallel checks share (tp_checks.py, tp_decoder.py): their sizes, a counter of the layers'
collectives, a gather of every rank's output, seeded random weights."""

from contextlib import contextmanager

import torch
import torch.distributed as dist

from minivllm.layers.linear import tp_size


def group() -> dist.ProcessGroup | None:
    """The group the layers built here shard over: the spawned rank's default group (helpers.spawn), None in a
    plain process (one rank)."""
    return dist.group.WORLD if dist.is_initialized() else None


HIDDEN, OUT, INTER, VOCAB = 64, 96, 128, 256  # small sizes, divisible by 1, 2 and 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
SEQ_LENS = [3, 4, 5]  # a packed prefill batch of three sequences


# --- counting collectives ----------------------------------------------------------------------------


@contextmanager
def count_collectives():
    """Wrap torch.distributed.all_reduce and gather (the layers call them as `dist.<name>`) and count."""
    counts = {"all_reduce": 0, "gather": 0}
    originals = {name: getattr(dist, name) for name in counts}

    def wrap(name):
        def counted(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return counted

    for name in counts:
        setattr(dist, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def all_gather_cat(y: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's tensor along the last dim (test-side gather, not counted)."""
    if tp_size(group()) == 1:
        return y
    parts = [torch.empty_like(y) for _ in range(tp_size(group()))]
    dist.all_gather(parts, y.contiguous())
    return torch.cat(parts, dim=-1)


def _rand(g: torch.Generator, *shape: int, scale: float = 0.1) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale
