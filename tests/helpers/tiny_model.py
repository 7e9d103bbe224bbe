"""Tiny random checkpoints in Hugging Face layout, made offline with transformers (for tests, notebooks and
benchmarks): a config, safetensors weights and a small byte-level BPE tokenizer trained on the spot."""

import os

import torch

ARCHS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    initializer_range=0.5,
)
# the tests' Llama: 6 query heads over 3 KV heads, head_dim from hidden_size, an LM head of its own
TINY_LLAMA = dict(
    num_attention_heads=6, num_key_value_heads=3, head_dim=None, hidden_size=96, tie_word_embeddings=False
)
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    initializer_range=0.02,
)

CHAT_TEMPLATE = (  # a minimal chat template for tiny checkpoints (tests, the serving notebook)
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital. "
    "minivllm is a small inference engine: paged KV cache, prefix caching, a scheduler and CUDA graphs. "
) * 20


def make_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 1000),
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def make_tiny_checkpoint(
    path: str,
    arch: str = "qwen3",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    chat_template: str | None = None,
    **overrides,
) -> str:
    """Write a random model of family `arch` to `path` (skipped if it is already there), its tokenizer with
    `chat_template` if given; returns path."""
    import transformers

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    config_cls, model_cls = (getattr(transformers, n) for n in ARCHS[arch])
    kwargs = {**TINY, **overrides}
    theta = kwargs.pop("rope_theta", 10000.0)
    tokenizer = make_tokenizer(kwargs["vocab_size"])
    config = config_cls(
        **kwargs,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = model_cls(config).to(dtype)
    if arch == "qwen2":  # transformers initialises biases to zero; make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(path)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return path
