"""A whole Qwen3 decoder layer under tensor parallelism (tp_checks.py runs it on every rank, and in a plain process
as the reference): built from one set of seeded weights, so each rank holds its shard of the same layer."""

import torch
from torch import nn

from helpers.tp_common import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    SEQ_LENS,
    VOCAB,
    _rand,
    count_collectives,
    group,
)
from minivllm.utils.context import reset_context, set_context


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

    layer = Qwen3DecoderLayer(config, qkv_bias=False, o_bias=False, qk_norm=True, group=group())
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
