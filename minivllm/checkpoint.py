"""Reading a Hugging Face checkpoint directory: its configuration (cheaply, when config.json is complete), its
tokenizer and its end-of-sequence tokens."""

import json
import os

# AutoTokenizer's modules are imported with the engine, not at its first tokenizer: imported after FlashAttention-4's
# they cost ~5 s more of the engine's start on a GPU (benchmarks/HISTORY.md)
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig

# what the engine reads from a checkpoint's config.json (the model's shape, its norm, activation and RoPE)
ENGINE_KEYS = (
    ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    + ("num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "hidden_act")
    + ("tie_word_embeddings",)
)


def load_hf_config(model: str) -> PretrainedConfig:
    """The checkpoint's configuration. When its config.json names every field the engine reads (ENGINE_KEYS and
    the RoPE base), a plain `PretrainedConfig` holding exactly those values: transformers' model-specific classes
    (LlamaConfig, Qwen3Config) add nothing then, and loading one costs ~1 s on a 2-core CPU (it validates
    `hidden_act` by importing transformers' activations, which import torch.distributed.tensor; README). A file
    that leaves a field to its model's defaults goes through AutoConfig, whose class supplies them."""
    with open(os.path.join(model, "config.json")) as f:
        values = json.load(f)
    rope_base = "rope_theta" in (values.get("rope_parameters") or {}) or "rope_theta" in values
    if all(k in values for k in ENGINE_KEYS) and rope_base:
        return PretrainedConfig(**values)
    return AutoConfig.from_pretrained(model)


def load_tokenizer(model: str, hf_config: PretrainedConfig):
    """The checkpoint's tokenizer. AutoTokenizer reads the model's config to choose a class; it is handed ours
    (not loaded a second time through AutoConfig) when tokenizer_config.json names the class itself."""
    path = os.path.join(model, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            if "tokenizer_class" in json.load(f):
                return AutoTokenizer.from_pretrained(model, config=hf_config)
    return AutoTokenizer.from_pretrained(model)


def eos_token_ids(model: str, tokenizer) -> list[int]:
    """The checkpoint's end-of-sequence tokens: its generation config's and its tokenizer's."""
    ids = set()
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
