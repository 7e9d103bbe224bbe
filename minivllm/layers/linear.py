"""The parallel Linear family (notebook 04): Column shards the output dim (`tp_dim` 0), Row the input dim (`tp_dim` 1)
and all_reduces over the engine's TP group (`group`, given at construction; None: one rank); QKV and Merged are Column
layers that pack several HF weights into one matrix. Each parameter carries a
`weight_loader(param, loaded_weight[, shard_id])` that the loader calls. The matmul is `F.linear`, or the engine's
kernel (`ops.linear`: on CPU through a weight packed once after the load, `pack_weight`). The TP helpers (`tp_rank`,
`tp_size`, `divide`, and the loaders' `shard_of` and `copy_weight`) serve every parallel layer; the engine makes the
group (engine/tp_workers.py)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minivllm.kernels.table import TORCH, Ops


def tp_rank(group: dist.ProcessGroup | None = None) -> int:
    return group.rank() if group is not None else 0


def tp_size(group: dist.ProcessGroup | None = None) -> int:
    return group.size() if group is not None else 1


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"tensor parallel size {denominator} does not divide {what} {numerator}")
    return numerator // denominator


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed=None) -> torch.Tensor:
    """x (..., in) -> (..., out): the torch definition (`packed` is the kernel's, unused here)."""
    return F.linear(x, weight, bias)


def copy_weight(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    """param <- loaded, whose shape must be param's (`what` names the layer in the error)."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"{what}: checkpoint shape {tuple(loaded.shape)} does not match parameter shard shape {tuple(param.shape)}"
        )
    param.copy_(loaded)


def shard_of(loaded: torch.Tensor, dim: int, shard_size: int, rank: int, tp: int, what: str) -> torch.Tensor:
    """Rank `rank`'s slice of `loaded` along `dim`, which must hold exactly tp shards (narrow() would cut a longer
    checkpoint silently)."""
    if loaded.size(dim) != shard_size * tp:
        raise ValueError(
            f"{what}: checkpoint shape {tuple(loaded.shape)} has {loaded.size(dim)} along dim {dim}, "
            f"expected {tp} x {shard_size}"
        )
    return loaded.narrow(dim, rank * shard_size, shard_size)


class LinearBase(nn.Module):
    tp_dim: int | None = None  # the weight's dim cut over the TP ranks: 0 output (Column), 1 input (Row), None whole

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        ops: Ops = TORCH,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """A layer of the full sizes; this rank holds its 1 / tp_size of the dim `tp_dim` (the bias: of the output)."""
        super().__init__()
        self.group = group
        self.tp_rank = tp_rank(group)
        self.tp_size = tp_size(group)
        if self.tp_dim == 0:
            output_size = divide(output_size, self.tp_size, "output size")
        elif self.tp_dim == 1:
            input_size = divide(input_size, self.tp_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed_weight: torch.Tensor | None = None  # the kernel's copy of the weight (CPU: oneDNN's layout)
        self._linear, self._pack = ops.linear or linear, ops.pack_linear

    def pack_weight(self) -> bool:
        """After the load: the kernel's copy of the weight, where the engine's kernel has one; whether it has."""
        self.packed_weight = self._pack(self.weight) if self._pack else None
        return self.packed_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"{type(self).__name__}: input last dim {x.shape[-1]} != in_features {self.weight.shape[1]}"
            )
        return self._linear(x, self.weight, self.bias, self.packed_weight)


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        copy_weight(param.data, loaded_weight, type(self).__name__)


class ColumnParallelLinear(LinearBase):
    """y[:, shard] = x @ W[shard].T: each rank holds output rows [rank * n, (rank + 1) * n)."""

    tp_dim = 0

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard_size, name = param.data.size(self.tp_dim), type(self).__name__
        loaded_weight = shard_of(loaded_weight, self.tp_dim, shard_size, self.tp_rank, self.tp_size, name)
        copy_weight(param.data, loaded_weight, name)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers side by side (gate_proj, up_proj); integer shard ids index output_sizes."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        *,
        ops: Ops = TORCH,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, ops=ops, group=group)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int) -> None:
        shard_offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
        param_data = param.data.narrow(self.tp_dim, shard_offset, shard_size)
        loaded_weight = loaded_weight.chunk(self.tp_size, self.tp_dim)[self.tp_rank]
        copy_weight(param_data, loaded_weight, f"{type(self).__name__}[{loaded_shard_id}]")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix, sharded by head; string shard ids "q", "k", "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        *,
        ops: Ops = TORCH,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp = tp_size(group)
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp, "number of attention heads")
        self.num_kv_heads = divide(total_num_kv_heads, tp, "number of KV heads")
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias, ops=ops, group=group)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        shards = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}  # (offset, size)
        shard_offset, shard_size = shards[loaded_shard_id]
        param_data = param.data.narrow(self.tp_dim, shard_offset, shard_size)
        loaded_weight = loaded_weight.chunk(self.tp_size, self.tp_dim)[self.tp_rank]
        copy_weight(param_data, loaded_weight, f"{type(self).__name__}[{loaded_shard_id}]")


class RowParallelLinear(LinearBase):
    """y = sum over ranks of x[:, shard] @ W[:, shard].T: partial sums, then one all_reduce."""

    tp_dim = 1

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        name = type(self).__name__
        if param.data.dim() == 2:  # the weight; the bias is whole on every rank
            shard_size = param.data.size(self.tp_dim)
            loaded_weight = shard_of(loaded_weight, self.tp_dim, shard_size, self.tp_rank, self.tp_size, name)
        copy_weight(param.data, loaded_weight, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"RowParallelLinear: input last dim {x.shape[-1]} != in_features shard {self.weight.shape[1]}"
            )
        bias = self.bias if self.tp_rank == 0 else None  # bias once, on rank 0
        y = self._linear(x, self.weight, bias, self.packed_weight)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.group)
        return y
