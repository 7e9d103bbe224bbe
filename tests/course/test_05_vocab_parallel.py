"""Chapter 05: VocabParallelEmbedding's weight loader and forward, ParallelLMHead's forward and project
(minivllm/layers/embed_head.py), every rank of a TP group played in turn (tp_fakes.py)."""

import torch

from course.tp_fakes import Collectives, FakeGroup
from helpers.course import assert_close, assert_exact, expect_error, odd_size, seeded
from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from minivllm.utils.context import reset_context, set_context

TP = 3


def table(seed: int):
    gen = seeded(seed)
    vocab, dim = TP * odd_size(gen, 5, 30), odd_size(gen, 5, 40)
    return torch.randn(vocab, dim, generator=gen), gen


def test_weight_loader():
    full, _ = table(20)
    vocab, shard = full.shape[0], full.shape[0] // TP
    for rank in range(TP):
        emb = VocabParallelEmbedding(vocab, full.shape[1], group=FakeGroup(rank, TP))
        emb.weight.weight_loader(emb.weight, full)
        exercise = "VocabParallelEmbedding.weight_loader"
        assert_exact(emb.weight.data, full[rank * shard : (rank + 1) * shard], exercise, f"rank {rank}: rows")
        with expect_error(ValueError, exercise, "a checkpoint with a longer vocabulary (narrow() cuts silently)"):
            emb.weight.weight_loader(emb.weight, torch.randn(vocab + TP, full.shape[1]))


def test_embedding_forward(monkeypatch):
    full, gen = table(21)
    vocab = full.shape[0]
    ids = torch.randint(0, vocab, (odd_size(gen, 5, 40),), generator=gen)
    one = VocabParallelEmbedding(vocab, full.shape[1])
    one.weight.weight_loader(one.weight, full)
    assert_exact(one(ids), full[ids], "VocabParallelEmbedding.forward", "one rank: the rows of the ids")
    comm = Collectives().install(monkeypatch)
    for rank in range(TP):
        emb = VocabParallelEmbedding(vocab, full.shape[1], group=FakeGroup(rank, TP))
        emb.weight.weight_loader(emb.weight, full)
        emb(ids)
    exercise = "VocabParallelEmbedding.forward"
    assert len(comm.reduced) == TP, f"{exercise}: expected one all_reduce per rank, got {len(comm.reduced)}"
    shard = vocab // TP
    for rank, part in enumerate(comm.reduced):
        owned = (ids >= rank * shard) & (ids < (rank + 1) * shard)
        expected = torch.where(owned[:, None], full[ids], 0.0)
        assert_exact(part, expected, exercise, f"rank {rank}'s part (its own tokens' rows, zeros elsewhere)")


def test_lm_head_forward_and_project(monkeypatch):
    full, gen = table(22)
    vocab, dim = full.shape
    x = torch.randn(odd_size(gen, 7, 30), dim, generator=gen)
    head = ParallelLMHead(vocab, dim)
    head.weight.weight_loader(head.weight, full)
    exact = x.double() @ full.double().T
    assert_close(head.project(x), exact, "ParallelLMHead.project", "logits of every row", oracle=x @ full.T)
    cu = torch.tensor([0, 2, 3, x.shape[0]], dtype=torch.int32)  # three sequences of a prefill
    try:
        set_context(True, cu_seqlens_q=cu)
        last = cu[1:].long() - 1
        assert_close(
            head(x),
            exact[last],
            "ParallelLMHead.forward",
            "prefill: the last token of each sequence",
            oracle=x[last] @ full.T,
        )
        set_context(False)
        assert_close(head(x), exact, "ParallelLMHead.forward", "decode: every row", oracle=x @ full.T)
        Collectives().install(monkeypatch)
        heads = []
        for rank in range(TP):
            h = ParallelLMHead(vocab, dim, group=FakeGroup(rank, TP))
            h.weight.weight_loader(h.weight, full)
            heads.append(h)
        for rank in [*range(1, TP), 0]:  # ranks 1.. gather to rank 0, which gets the whole vocabulary
            got = heads[rank].project(x)
            if rank:
                assert got is None, f"ParallelLMHead.project: rank {rank} must return None (logits on rank 0 only)"
        assert_close(
            got, exact, "ParallelLMHead.project", f"rank 0's logits, gathered from {TP} ranks", oracle=x @ full.T
        )
    finally:
        reset_context()
