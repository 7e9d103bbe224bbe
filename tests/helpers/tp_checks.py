"""Tensor-parallel checks that run in spawned gloo processes (tests/test_tp.py, notebooks 04 and 05).

Every rank builds the same full weights from one seed, loads its shard through the layers' weight_loaders,
runs the sharded layer, and returns its output next to the unsharded result computed with plain torch on
the full weights, together with how many all_reduce / gather calls the layer made. The decoder-layer
helpers also run in a plain process (TP=1), which is the reference for TP=2. Spawned functions must be
importable, so they live here and not in a notebook cell. Run them with
`helpers.spawn.run_tp(tp_worker, world_size, (seed,))`; `engine_steps` joins its engine's own group
(`run_tp(engine_steps, 2, (model, free_port(), prompts), group=False)`)."""

import torch
import torch.nn.functional as F

from helpers.tp_common import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    OUT,
    SEQ_LENS,
    VOCAB,
    _rand,
    all_gather_cat,
    count_collectives,
    group,
)
from helpers.tp_decoder import run_decoder_layer, tiny_qwen3_config
from minivllm.engine.tp_workers import min_over_ranks
from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    tp_rank,
    tp_size,
)
from minivllm.utils.context import reset_context, set_context

# --- the parallel Linear family ------------------------------------------------------------------------


def linear_checks(seed: int = 0) -> dict[str, dict]:
    """Column (gathered), Row (reduced), QKV and Merged (gathered per shard id) vs full-weight F.linear."""
    g = torch.Generator().manual_seed(seed)
    x = _rand(g, 7, HIDDEN, scale=1.0)  # (N, H), the same on every rank
    out = {}

    w, b = _rand(g, OUT, HIDDEN), _rand(g, OUT)
    layer = ColumnParallelLinear(HIDDEN, OUT, bias=True, group=group())
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    with count_collectives() as n:
        y = layer(x)  # (N, OUT / tp)
    out["column"] = dict(out=all_gather_cat(y), ref=F.linear(x, w, b), shard_shape=tuple(layer.weight.shape), **n)

    w, b = _rand(g, HIDDEN, OUT), _rand(g, HIDDEN)
    xr = _rand(g, 7, OUT, scale=1.0)  # (N, OUT)
    layer = RowParallelLinear(OUT, HIDDEN, bias=True, group=group())
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    shard, rank = OUT // tp_size(group()), tp_rank(group())
    with count_collectives() as n:
        y = layer(xr[:, rank * shard : (rank + 1) * shard])  # this rank's input slice -> (N, H)
    out["row"] = dict(out=y, ref=F.linear(xr, w, b), shard_shape=tuple(layer.weight.shape), **n)

    wq, wk, wv = (
        _rand(g, HEADS * HEAD_DIM, HIDDEN),
        _rand(g, KV_HEADS * HEAD_DIM, HIDDEN),
        _rand(g, KV_HEADS * HEAD_DIM, HIDDEN),
    )
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, group=group())
    for shard_id, wt in zip("qkv", (wq, wk, wv)):
        layer.weight.weight_loader(layer.weight, wt, shard_id)
    with count_collectives() as n:
        y = layer(x)  # (N, (heads + 2 kv_heads) * D / tp)
    q, k, v = y.split([layer.num_heads * HEAD_DIM, layer.num_kv_heads * HEAD_DIM, layer.num_kv_heads * HEAD_DIM], -1)
    out["qkv"] = dict(
        out=torch.cat([all_gather_cat(t) for t in (q, k, v)], -1),
        ref=torch.cat([F.linear(x, wt) for wt in (wq, wk, wv)], -1),
        shard_shape=tuple(layer.weight.shape),
        **n,
    )

    wg, wu = _rand(g, INTER, HIDDEN), _rand(g, INTER, HIDDEN)
    layer = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], group=group())
    for shard_id, wt in enumerate((wg, wu)):
        layer.weight.weight_loader(layer.weight, wt, shard_id)
    with count_collectives() as n:
        gate, up = layer(x).chunk(2, -1)  # 2 x (N, I / tp)
    out["merged"] = dict(
        out=torch.cat([all_gather_cat(gate), all_gather_cat(up)], -1),
        ref=torch.cat([F.linear(x, wg), F.linear(x, wu)], -1),
        shard_shape=tuple(layer.weight.shape),
        **n,
    )
    return out


# --- vocab-parallel embedding and LM head ----------------------------------------------------------


def vocab_checks(seed: int = 0) -> dict[str, dict]:
    """VocabParallelEmbedding (mask + all_reduce) and ParallelLMHead (last tokens in prefill, every row in
    decode, gathered to rank 0; other ranks get None) vs F.embedding / F.linear on the full table."""
    g = torch.Generator().manual_seed(seed + 1)
    w = _rand(g, VOCAB, HIDDEN, scale=1.0)  # (V, H)
    ids = torch.randint(0, VOCAB, (sum(SEQ_LENS),), generator=g)  # (N,)
    ids[:4] = torch.tensor([0, VOCAB // 2 - 1, VOCAB // 2, VOCAB - 1])  # both ends of each rank's range (TP=2)
    out = {}

    emb = VocabParallelEmbedding(VOCAB, HIDDEN, group=group())
    emb.weight.weight_loader(emb.weight, w)
    with count_collectives() as n:
        y = emb(ids)  # (N, H)
    out["embedding"] = dict(
        out=y,
        ref=F.embedding(ids, w),
        shard_shape=tuple(emb.weight.shape),
        vocab_range=(emb.vocab_start_idx, emb.vocab_end_idx),
        **n,
    )

    head = ParallelLMHead(VOCAB, HIDDEN, group=group())
    head.weight.weight_loader(head.weight, w)
    hidden = _rand(g, sum(SEQ_LENS), HIDDEN, scale=1.0)  # (N, H), packed prefill batch
    cu_seqlens = torch.tensor([0] + SEQ_LENS).cumsum(0).to(torch.int32)  # (num_seqs + 1,)
    set_context(
        True, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max(SEQ_LENS), max_seqlen_k=max(SEQ_LENS)
    )
    with count_collectives() as n:
        logits = head(hidden)  # (num_seqs, V) on rank 0, else None
    last = (cu_seqlens[1:] - 1).long()
    out["lm_head_prefill"] = dict(out=logits, ref=F.linear(hidden[last], w), shard_shape=tuple(head.weight.shape), **n)

    set_context(False)
    hidden = _rand(g, len(SEQ_LENS), HIDDEN, scale=1.0)  # (num_seqs, H), one token each
    with count_collectives() as n:
        logits = head(hidden)
    out["lm_head_decode"] = dict(out=logits, ref=F.linear(hidden, w), shard_shape=tuple(head.weight.shape), **n)
    reset_context()
    return out


# --- what a TP degree must divide --------------------------------------------------------------------


def error_checks() -> dict[str, str | None]:
    """Build layers whose sizes this world size does not divide; return each ValueError's message."""
    from minivllm.models.qwen3 import Qwen3DecoderLayer

    cases = {
        "kv_heads": lambda: Qwen3DecoderLayer(
            tiny_qwen3_config(num_attention_heads=6, num_key_value_heads=3),
            qkv_bias=False,
            o_bias=False,
            qk_norm=True,
            group=group(),
        ),
        "vocab": lambda: VocabParallelEmbedding(VOCAB + 1, HIDDEN, group=group()),
        "column": lambda: ColumnParallelLinear(HIDDEN, OUT + 1, group=group()),
        "row": lambda: RowParallelLinear(OUT + 1, HIDDEN, group=group()),
    }
    messages = {}
    for name, build in cases.items():
        try:
            build()
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages


# --- the ranks' agreement on the KV block count --------------------------------------------------------


def agree_min_check(rank: int) -> int:
    """The runner's agreement on the block count (engine/tp_workers.min_over_ranks) with a different count on each rank
    (40, 25, 10, ...): every rank must get the smallest."""
    return min_over_ranks(40 - 15 * rank, torch.device("cpu"), group())


# --- the spawned entry point -------------------------------------------------------------------------


def tp_worker(
    rank: int,
    world_size: int,
    seed: int = 0,
    parts: tuple[str, ...] = ("linear", "vocab", "decoder", "errors", "agree_min"),
) -> dict:
    """Run the requested checks on this rank; the result travels back to the parent through run_tp."""
    torch.manual_seed(seed)
    run = {"linear": linear_checks, "vocab": vocab_checks, "decoder": run_decoder_layer}
    with torch.no_grad():
        result = {part: run[part](seed) for part in parts if part in run}
    if "errors" in parts:
        result["errors"] = error_checks()
    if "agree_min" in parts:
        result["agree_min"] = agree_min_check(rank)
    result["rank"], result["world_size"] = tp_rank(group()), tp_size(group())
    return result
