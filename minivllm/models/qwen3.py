"""Qwen3 (notebook 10), and with the same classes Qwen2 (q/k/v bias, no QK-norm) and Llama
(no bias, no QK-norm). forward stops at the hidden state; compute_logits is separate so a CUDA graph can
end before the LM head. What the engine chose is given at construction and passed down to each layer: its
kernels (`ops`, minivllm/kernels), its attention backend (`attn_backend`) and its TP process group (`group`)."""

import torch
import torch.distributed as dist
from torch import nn

from minivllm.kernels.table import TORCH, AttentionBackend, Ops
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.attention import Attention
from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.rotary_embedding import get_rope, rope_scaling_of, rope_theta_of

# architecture -> (q/k/v bias, o_proj bias, QK-norm), as in transformers; None = config.attention_bias
ARCHITECTURES = {
    "Qwen3ForCausalLM": (None, None, True),
    "Qwen2ForCausalLM": (True, False, False),
    "LlamaForCausalLM": (None, None, False),
}


def architecture_of(hf_config) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise ValueError(f"unsupported architecture {archs}: minivllm supports {sorted(ARCHITECTURES)}")


class Qwen3Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        max_position: int,
        head_dim: int | None,
        rms_norm_eps: float,
        qkv_bias: bool,
        qk_norm: bool,
        rope_theta: float,
        rope_scaling: tuple | None,
        o_bias: bool = False,
        *,
        ops: Ops = TORCH,
        attn_backend: AttentionBackend | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim or hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, num_heads, num_kv_heads, bias=qkv_bias, ops=ops, group=group
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden_size, bias=o_bias, ops=ops, group=group)
        self.rotary_emb = get_rope(self.head_dim, self.head_dim, max_position, rope_theta, rope_scaling, ops=ops)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.scaling, self.num_kv_heads, ops=ops, backend=attn_backend
        )
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=rms_norm_eps, ops=ops)
            self.k_norm = RMSNorm(self.head_dim, eps=rms_norm_eps, ops=ops)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # (N, q_size + 2 kv_size)
        if self.attn.prologue is not None:  # the engine has QK-norm, RoPE and the KV-cache write in one kernel
            q_norm, k_norm = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
            o = self.attn.forward_fused(qkv, positions, self.rotary_emb.cos_sin_cache, q_norm, k_norm)
            return self.o_proj(o.flatten(1, -1))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (N, heads, head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (N, kv_heads, head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # per-head RMSNorm (Qwen3)
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)  # (N, heads, head_dim)
        return self.o_proj(o.flatten(1, -1))  # (N, hidden)


class Qwen3MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        *,
        ops: Ops = TORCH,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported activation {hidden_act!r}: only silu (SwiGLU)")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, ops=ops, group=group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, ops=ops, group=group)
        self.act_fn = SiluAndMul(ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # (N, H) -> (N, 2I) -> (N, I) -> (N, H)


class Qwen3DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        *,
        ops: Ops = TORCH,
        attn_backend: AttentionBackend | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            max_position=config.max_position_embeddings,
            head_dim=getattr(config, "head_dim", None),
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            rope_theta=rope_theta_of(config),
            rope_scaling=(lambda s: tuple(sorted(s.items())) if s else None)(rope_scaling_of(config)),
            o_bias=o_bias,
            ops=ops,
            attn_backend=attn_backend,
            group=group,
        )
        self.mlp = Qwen3MLP(config.hidden_size, config.intermediate_size, config.hidden_act, ops=ops, group=group)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, ops=ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, ops=ops)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class Qwen3Model(nn.Module):
    def __init__(
        self,
        config,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        *,
        ops: Ops = TORCH,
        attn_backend: AttentionBackend | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group=group)
        built = dict(ops=ops, attn_backend=attn_backend, group=group)  # the engine's choices, for every layer
        self.layers = nn.ModuleList(
            [Qwen3DecoderLayer(config, qkv_bias, o_bias, qk_norm, **built) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, ops=ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # (N, hidden)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (our packed parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        config,
        *,
        ops: Ops = TORCH,
        attn_backend: AttentionBackend | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        qkv_bias, o_bias, qk_norm = (
            getattr(config, "attention_bias", False) if b is None else b for b in ARCHITECTURES[architecture_of(config)]
        )
        self.model = Qwen3Model(config, qkv_bias, o_bias, qk_norm, ops=ops, attn_backend=attn_backend, group=group)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ops=ops, group=group)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight.data = self.model.embed_tokens.weight.data  # one storage for both

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)
