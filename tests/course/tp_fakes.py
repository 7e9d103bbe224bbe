"""Tensor parallelism without processes, for chapters 04-05: a group that only says its rank and size, and
collectives that record what each rank sends, so a check can play every rank in turn and combine their parts."""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class FakeGroup:
    rank_: int
    size_: int

    def rank(self) -> int:
        return self.rank_

    def size(self) -> int:
        return self.size_


@dataclass
class Collectives:
    """Replaces dist.all_reduce and dist.gather while installed: all_reduce keeps its tensor as it is (the check
    sums the ranks' parts), gather hands rank 0 the tensors other ranks gathered before it."""

    reduced: list[torch.Tensor] = field(default_factory=list)
    gathered: list[torch.Tensor] = field(default_factory=list)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.reduced.append(tensor.clone())

    def gather(self, tensor, gather_list=None, group=None, group_dst=0, **_):
        if gather_list is None:
            self.gathered.append(tensor.clone())
            return
        parts = [tensor, *self.gathered]
        assert len(parts) == len(gather_list), "gather: play ranks 1.. before rank 0"
        for slot, part in zip(gather_list, parts):
            slot.copy_(part)

    def install(self, monkeypatch) -> "Collectives":
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)
        monkeypatch.setattr(dist, "gather", self.gather)
        return self
