"""Tensor-parallel checks that run in spawned gloo processes (tests/test_tp.py, notebooks 04 and 05).

Every rank builds the same full weights from one seed, loads its shard through the layers' weight_loaders,
runs the sharded layer, and returns its output next to the unsharded result computed with plain torch on
the full weights, together with how many all_reduce / gather calls the layer made. The decoder-layer
helpers also run in a plain process (TP=1), which is the reference for TP=2. Spawned functions must be
importable, so they live here and not in a notebook cell. Run them with
`minivllm.testing.spawn.run_tp(tp_worker, world_size, (seed,))`; `engine_steps` joins its engine's own group
(`run_tp(engine_steps, 2, (model, free_port(), prompts), group=False)`)."""

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.utils.context import reset_context, set_context
from minivllm.utils.dist import tp_rank, tp_size

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
    if tp_size() == 1:
        return y
    parts = [torch.empty_like(y) for _ in range(tp_size())]
    dist.all_gather(parts, y.contiguous())
    return torch.cat(parts, dim=-1)


def _rand(g: torch.Generator, *shape: int, scale: float = 0.1) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


# --- the parallel Linear family ------------------------------------------------------------------------


def linear_checks(seed: int = 0) -> dict[str, dict]:
    """Column (gathered), Row (reduced), QKV and Merged (gathered per shard id) vs full-weight F.linear."""
    g = torch.Generator().manual_seed(seed)
    x = _rand(g, 7, HIDDEN, scale=1.0)  # (N, H), the same on every rank
    out = {}

    w, b = _rand(g, OUT, HIDDEN), _rand(g, OUT)
    layer = ColumnParallelLinear(HIDDEN, OUT, bias=True)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    with count_collectives() as n:
        y = layer(x)  # (N, OUT / tp)
    out["column"] = dict(out=all_gather_cat(y), ref=F.linear(x, w, b), shard_shape=tuple(layer.weight.shape), **n)

    w, b = _rand(g, HIDDEN, OUT), _rand(g, HIDDEN)
    xr = _rand(g, 7, OUT, scale=1.0)  # (N, OUT)
    layer = RowParallelLinear(OUT, HIDDEN, bias=True)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    shard = OUT // tp_size()
    with count_collectives() as n:
        y = layer(xr[:, tp_rank() * shard : (tp_rank() + 1) * shard])  # this rank's input slice -> (N, H)
    out["row"] = dict(out=y, ref=F.linear(xr, w, b), shard_shape=tuple(layer.weight.shape), **n)

    wq, wk, wv = (
        _rand(g, HEADS * HEAD_DIM, HIDDEN),
        _rand(g, KV_HEADS * HEAD_DIM, HIDDEN),
        _rand(g, KV_HEADS * HEAD_DIM, HIDDEN),
    )
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS)
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
    layer = MergedColumnParallelLinear(HIDDEN, [INTER, INTER])
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

    emb = VocabParallelEmbedding(VOCAB, HIDDEN)
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

    head = ParallelLMHead(VOCAB, HIDDEN)
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


# --- a whole Qwen3 decoder layer ---------------------------------------------------------------------


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return Qwen3Config(**(kw | overrides))


def decoder_layer_weights(config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights under Hugging Face names, as a checkpoint stores them."""
    g = torch.Generator().manual_seed(seed + 2)
    H, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    qh, kvh = config.num_attention_heads, config.num_key_value_heads
    shapes = {
        "self_attn.q_proj.weight": (qh * D, H),
        "self_attn.k_proj.weight": (kvh * D, H),
        "self_attn.v_proj.weight": (kvh * D, H),
        "self_attn.o_proj.weight": (H, qh * D),
        "mlp.gate_proj.weight": (I, H),
        "mlp.up_proj.weight": (I, H),
        "mlp.down_proj.weight": (H, I),
    }
    weights = {name: _rand(g, *shape, scale=shape[1] ** -0.5) for name, shape in shapes.items()}
    for name, dim in (
        ("self_attn.q_norm.weight", D),
        ("self_attn.k_norm.weight", D),
        ("input_layernorm.weight", H),
        ("post_attention_layernorm.weight", H),
    ):
        weights[name] = 1.0 + _rand(g, dim)  # not all ones, so a mix-up shows
    return weights


def build_decoder_layer(config, weights: dict[str, torch.Tensor]) -> nn.Module:
    """A Qwen3DecoderLayer for this process's TP size, loaded like the checkpoint loader does."""
    from minivllm.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM

    layer = Qwen3DecoderLayer(config, qkv_bias=False, o_bias=False, qk_norm=True)
    params = dict(layer.named_parameters())
    for name, w in weights.items():
        for hf_name, (packed, shard_id) in Qwen3ForCausalLM.packed_modules_mapping.items():
            if f".{hf_name}." in f".{name}":
                param = params[name.replace(hf_name, packed)]
                param.weight_loader(param, w, shard_id)
                break
        else:
            param = params[name]
            if hasattr(param, "weight_loader"):
                param.weight_loader(param, w)
            else:  # RMSNorm weights: copied whole
                param.data.copy_(w)
    return layer


def decoder_layer_inputs(config, seed: int = 0):
    """A packed prefill batch: positions restart at 0 for each sequence; hidden states and a residual."""
    g = torch.Generator().manual_seed(seed + 3)
    positions = torch.cat([torch.arange(n) for n in SEQ_LENS])  # (N,)
    hidden = _rand(g, sum(SEQ_LENS), config.hidden_size, scale=1.0)  # (N, H)
    residual = _rand(g, sum(SEQ_LENS), config.hidden_size, scale=1.0)  # (N, H)
    cu_seqlens = torch.tensor([0] + SEQ_LENS).cumsum(0).to(torch.int32)
    return positions, hidden, residual, cu_seqlens


def run_decoder_layer(seed: int = 0) -> dict:
    """One prefill step of a decoder layer with fresh K/V (no cache allocated), first layer (residual None)
    and a later layer (residual given); returns outputs and the collectives each call made."""
    config = tiny_qwen3_config()
    layer = build_decoder_layer(config, decoder_layer_weights(config, seed))
    positions, hidden, residual, cu_seqlens = decoder_layer_inputs(config, seed)
    set_context(
        True, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max(SEQ_LENS), max_seqlen_k=max(SEQ_LENS)
    )
    with torch.no_grad():
        with count_collectives() as first:
            h1, r1 = layer(positions, hidden, None)
        with count_collectives() as later:
            h2, r2 = layer(positions, hidden, residual)
    reset_context()
    return dict(
        first=(h1, r1),
        later=(h2, r2),
        all_reduce=later["all_reduce"],
        all_reduce_first=first["all_reduce"],
        gather=later["gather"],
        q_heads_per_rank=layer.self_attn.num_heads,
        kv_heads_per_rank=layer.self_attn.num_kv_heads,
    )


# --- what a TP degree must divide --------------------------------------------------------------------


def error_checks() -> dict[str, str | None]:
    """Build layers whose sizes this world size does not divide; return each ValueError's message."""
    from minivllm.models.qwen3 import Qwen3DecoderLayer

    cases = {
        "kv_heads": lambda: Qwen3DecoderLayer(
            tiny_qwen3_config(num_attention_heads=6, num_key_value_heads=3), qkv_bias=False, o_bias=False, qk_norm=True
        ),
        "vocab": lambda: VocabParallelEmbedding(VOCAB + 1, HIDDEN),
        "column": lambda: ColumnParallelLinear(HIDDEN, OUT + 1),
        "row": lambda: RowParallelLinear(OUT + 1, HIDDEN),
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
    """ModelRunner.agree_min with a different block count on each rank (40, 25, 10, ...): every rank must get
    the smallest. Only world_size and device of the runner are used, so no model is built."""
    from minivllm.engine.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.world_size, runner.device = tp_size(), torch.device("cpu")
    return runner.agree_min(40 - 15 * rank)


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
    result["rank"], result["world_size"] = tp_rank(), tp_size()
    return result
