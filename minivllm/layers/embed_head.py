"""Vocab-parallel embedding (mask + all_reduce) and LM head (last token per sequence in prefill, gather
to rank 0) over the engine's TP group (`group`, given at construction; None: one rank); notebook 05."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minivllm.kernels.table import TORCH, Ops
from minivllm.layers.linear import copy_weight, divide, linear, shard_of, tp_rank, tp_size
from minivllm.utils.context import get_context


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.tp_rank = tp_rank(group)
        self.tp_size = tp_size(group)
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size, "vocabulary size")
        self.vocab_start_idx = self.num_embeddings_per_partition * self.tp_rank
        self.vocab_end_idx = self.vocab_start_idx + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard_size, name = param.data.size(0), type(self).__name__  # rows of the vocabulary, whole on tp ranks
        copy_weight(param.data, shard_of(loaded_weight, 0, shard_size, self.tp_rank, self.tp_size, name), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (N,) token ids -> (N, embedding_dim)
        if self.tp_size > 1:
            mask = (x >= self.vocab_start_idx) & (x < self.vocab_end_idx)  # tokens this rank owns
            x = mask * (x - self.vocab_start_idx)  # local ids, others -> 0
        y = F.embedding(x, self.weight)
        if self.tp_size > 1:
            y = mask.unsqueeze(1) * y  # zero rows we do not own
            dist.all_reduce(y, group=self.group)  # exactly one rank is non-zero
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head (no bias): the embedding's vocabulary shards, used as a linear layer."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, ops: Ops = TORCH, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, group=group)
        self.packed_weight: torch.Tensor | None = None  # the kernel's copy of the weight (CPU: oneDNN's layout)
        self._linear, self._pack = ops.linear or linear, ops.pack_linear

    def pack_weight(self) -> bool:
        """After the load (and the tie to the embedding): the kernel's copy of the weight, where it has one."""
        self.packed_weight = self._pack(self.weight) if self._pack else None
        return self.packed_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        context = get_context()
        if context.is_prefill:
            last_indices = context.cu_seqlens_q[1:] - 1  # last token of each sequence
            x = x[last_indices].contiguous()  # (num_seqs, hidden)
        return self.project(x)

    def project(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits (N, vocab) of every row of x (N, hidden), on rank 0 (prompt logprobs read every position)."""
        logits = self._linear(x, self.weight, None, self.packed_weight)  # (num_seqs, vocab / tp)
        if self.tp_size > 1:
            all_logits = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
            dist.gather(logits, all_logits, group=self.group, group_dst=0)
            logits = torch.cat(all_logits, -1) if self.tp_rank == 0 else None  # (num_seqs, vocab) on rank 0
        return logits
