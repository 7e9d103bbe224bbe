"""Chapter 04: the parallel linears' weight loaders and forwards (minivllm/layers/linear.py), every rank of a
TP group played in turn (tp_fakes.py), fp32 and bf16."""

import pytest
import torch
import torch.nn.functional as F

from course.tp_fakes import Collectives, FakeGroup
from helpers.course import DTYPES, assert_close, assert_exact, expect_error, odd_size, seeded
from minivllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

IDS = ["fp32", "bf16"]
TP = 3


def test_column_weight_loader():
    gen = seeded(10)
    n_in, n_out = odd_size(gen, 5, 40), TP * odd_size(gen, 3, 20)
    full, bias = torch.randn(n_out, n_in, generator=gen), torch.randn(n_out, generator=gen)
    shard = n_out // TP
    for rank in range(TP):
        layer = ColumnParallelLinear(n_in, n_out, bias=True, group=FakeGroup(rank, TP))
        layer.weight.weight_loader(layer.weight, full)
        layer.bias.weight_loader(layer.bias, bias)
        rows = slice(rank * shard, (rank + 1) * shard)
        exercise = "ColumnParallelLinear.weight_loader"
        assert_exact(layer.weight.data, full[rows], exercise, f"rank {rank} of {TP}: weight rows")
        assert_exact(layer.bias.data, bias[rows], exercise, f"rank {rank} of {TP}: bias")
        with expect_error(ValueError, exercise, "a checkpoint with more rows than tp shards (narrow() cuts silently)"):
            layer.weight.weight_loader(layer.weight, torch.randn(n_out + TP, n_in))


def test_merged_weight_loader():
    gen = seeded(11)
    n_in, sizes = odd_size(gen, 5, 40), [TP * odd_size(gen, 3, 12), TP * odd_size(gen, 3, 12)]
    parts = [torch.randn(n, n_in, generator=gen) for n in sizes]
    for rank in range(TP):
        layer = MergedColumnParallelLinear(n_in, sizes, group=FakeGroup(rank, TP))
        for shard_id, part in enumerate(parts):
            layer.weight.weight_loader(layer.weight, part, shard_id)
        expected = torch.cat([p.chunk(TP)[rank] for p in parts])  # this rank's rows of gate, then of up
        assert_exact(
            layer.weight.data, expected, "MergedColumnParallelLinear.weight_loader", f"rank {rank}: gate then up rows"
        )


def test_qkv_weight_loader():
    gen = seeded(12)
    head, heads, kv_heads = odd_size(gen, 3, 12), 2 * TP, TP
    hidden = odd_size(gen, 5, 40)
    q, k, v = (torch.randn(n * head, hidden, generator=gen) for n in (heads, kv_heads, kv_heads))
    for rank in range(TP):
        layer = QKVParallelLinear(hidden, head, heads, kv_heads, group=FakeGroup(rank, TP))
        for shard_id, w in zip("qkv", (q, k, v)):
            layer.weight.weight_loader(layer.weight, w, shard_id)
        expected = torch.cat([w.chunk(TP)[rank] for w in (q, k, v)])  # this rank's heads of q, k, v
        assert_exact(layer.weight.data, expected, "QKVParallelLinear.weight_loader", f"rank {rank}: q, k, v rows")


def test_row_weight_loader():
    gen = seeded(13)
    n_in, n_out = TP * odd_size(gen, 3, 20), odd_size(gen, 5, 40)
    full, bias = torch.randn(n_out, n_in, generator=gen), torch.randn(n_out, generator=gen)
    shard = n_in // TP
    for rank in range(TP):
        layer = RowParallelLinear(n_in, n_out, bias=True, group=FakeGroup(rank, TP))
        layer.weight.weight_loader(layer.weight, full)
        layer.bias.weight_loader(layer.bias, bias)
        exercise = "RowParallelLinear.weight_loader"
        assert_exact(layer.weight.data, full[:, rank * shard : (rank + 1) * shard], exercise, f"rank {rank}: columns")
        assert_exact(layer.bias.data, bias, exercise, f"rank {rank}: the bias (whole on every rank)")
        with expect_error(ValueError, exercise, "a checkpoint with more columns than tp shards"):
            layer.weight.weight_loader(layer.weight, torch.randn(n_out, n_in + TP))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_linear_forward(dtype):
    gen = seeded(14)
    n_in, n_out = odd_size(gen, 5, 60), odd_size(gen, 5, 60)
    x = torch.randn(odd_size(gen, 3, 20), n_in, generator=gen).to(dtype)
    for cls in (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear):
        layer = cls(n_in, n_out, bias=True).to(dtype)
        torch.nn.init.normal_(layer.weight, generator=gen)
        torch.nn.init.normal_(layer.bias, generator=gen)
        exact = x.double() @ layer.weight.double().T + layer.bias.double()
        exercise = "RowParallelLinear.forward" if cls is RowParallelLinear else "LinearBase.forward"
        oracle = F.linear(x, layer.weight, layer.bias)
        assert_close(layer(x), exact, exercise, f"{cls.__name__}(x)", oracle=oracle, dtype=dtype)
        with expect_error(ValueError, exercise, "an input whose last dim is not in_features"):
            layer(torch.ones(2, n_in + 1, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_row_forward_all_reduces(dtype, monkeypatch):
    """Each rank's partial sum goes through one all_reduce; their sum is the whole product, the bias added once."""
    gen = seeded(15)
    n_in, n_out = TP * odd_size(gen, 3, 20), odd_size(gen, 5, 40)
    full, bias = torch.randn(n_out, n_in, generator=gen), torch.randn(n_out, generator=gen)
    x = torch.randn(odd_size(gen, 3, 20), n_in, generator=gen).to(dtype)
    comm = Collectives().install(monkeypatch)
    shard = n_in // TP
    for rank in range(TP):
        layer = RowParallelLinear(n_in, n_out, bias=True, group=FakeGroup(rank, TP))
        layer.weight.weight_loader(layer.weight, full)
        layer.bias.weight_loader(layer.bias, bias)
        layer.to(dtype)(x[:, rank * shard : (rank + 1) * shard])
    assert len(comm.reduced) == TP, (
        f"RowParallelLinear.forward: expected one all_reduce per rank ({TP}), got {len(comm.reduced)}"
    )
    total = sum(part.double() for part in comm.reduced)
    exact = x.double() @ full.to(dtype).double().T + bias.to(dtype).double()
    oracle = (
        sum(
            F.linear(x[:, r * shard : (r + 1) * shard], full.to(dtype)[:, r * shard : (r + 1) * shard]).double()
            for r in range(TP)
        )
        + bias.to(dtype).double()
    )
    assert_close(
        total.to(dtype),
        exact,
        "RowParallelLinear.forward",
        "the sum over ranks of the all_reduced parts",
        oracle=oracle.to(dtype),
        dtype=dtype,
    )
