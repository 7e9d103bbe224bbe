"""Engine arguments (minivllm/config.py), given to LLM(...): each bad value is refused before anything is
loaded, with an error naming it; `device="auto"` and `dtype="auto"` resolve as documented."""

import pytest
import torch

from minivllm import LLM
from minivllm.config import Config


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(gpu_memory_utilization=0), ValueError, r"gpu_memory_utilization must be in \(0, 1\], got 0"),
        (dict(gpu_memory_utilization=1.01), ValueError, r"gpu_memory_utilization must be in \(0, 1\], got 1.01"),
        (dict(gpu_memory_utilization=-0.5), ValueError, r"gpu_memory_utilization must be in \(0, 1\]"),
        (dict(device="tpu"), ValueError, "device must be auto, cpu or cuda, got 'tpu'"),
        (dict(dtype="int8"), ValueError, "dtype must be auto, float32, bfloat16 or float16, got 'int8'"),
        (dict(dtype="bf16"), ValueError, "dtype must be auto, float32, bfloat16 or float16, got 'bf16'"),
        (dict(kvcache_block_size=0), ValueError, "kvcache_block_size must be >= 1, got 0"),
        (dict(max_model_len=-1), ValueError, "max_model_len must be >= 1, got -1"),
        # 4 heads, 2 KV heads: 4 ranks divide the heads, not the KV heads
        (dict(tensor_parallel_size=4), ValueError, "tensor parallel size 4 does not divide num_key_value_heads 2"),
        (dict(tensor_parallel_size=3), ValueError, "tensor parallel size 3 does not divide num_attention_heads 4"),
        (dict(num_kvcache_block=8), TypeError, r"unknown engine argument\(s\) \['num_kvcache_block'\]"),
    ],
)
def test_bad_engine_arguments_are_named(tiny_qwen3, kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM(tiny_qwen3, **kwargs)


def test_cuda_without_a_gpu_is_refused(tiny_qwen3, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without CUDA
    with pytest.raises(ValueError, match="device='cuda' but no CUDA device is available"):
        LLM(tiny_qwen3, device="cuda")
    assert Config(tiny_qwen3).device == "cpu"  # auto


def test_auto_device_needs_a_gpu_for_every_rank(tiny_qwen3, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert Config(tiny_qwen3).device == "cuda"
    assert Config(tiny_qwen3, tensor_parallel_size=2).device == "cpu"  # one GPU, two ranks


def test_a_directory_without_config_json_is_named(tiny_qwen3, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no config.json \(expected a Hugging Face checkpoint"):
        LLM(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")  # weights alone are not a checkpoint either
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(tmp_path))


def test_auto_dtype_is_float32_on_cpu_and_the_checkpoints_on_a_gpu(tiny_qwen3, monkeypatch):
    assert Config(tiny_qwen3).torch_dtype() == torch.float32
    assert Config(tiny_qwen3, dtype="bfloat16").torch_dtype() == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # Config only: nothing touches the GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = Config(tiny_qwen3)
    config.hf_config.dtype = torch.bfloat16  # a checkpoint saved in bf16, as Qwen3's
    assert config.device == "cuda" and config.torch_dtype() == torch.bfloat16
    config.hf_config.dtype = "float16"  # as a string in older configs
    assert config.torch_dtype() == torch.float16
    assert Config(tiny_qwen3, dtype="float32").torch_dtype() == torch.float32


def _copy_checkpoint(src: str, dst, drop: str | None = None) -> str:
    import json
    import shutil

    shutil.copytree(src, dst)
    if drop:
        path = dst / "config.json"
        values = json.loads(path.read_text())
        del values[drop]
        path.write_text(json.dumps(values))
    return str(dst)


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen2", "tiny_llama"])
def test_a_complete_config_json_is_read_without_the_model_config_class(fixture, request):
    from transformers import AutoConfig, PretrainedConfig

    from minivllm.checkpoint import ENGINE_KEYS, load_hf_config
    from minivllm.layers.rotary_embedding import rope_scaling_of, rope_theta_of

    path = request.getfixturevalue(fixture)
    ours, theirs = load_hf_config(path), AutoConfig.from_pretrained(path)
    assert type(ours) is PretrainedConfig and type(theirs) is not PretrainedConfig
    for key in ENGINE_KEYS + ("model_type", "eos_token_id", "attention_bias"):
        assert getattr(ours, key, None) == getattr(theirs, key, None), key
    assert rope_theta_of(ours) == rope_theta_of(theirs) and rope_scaling_of(ours) == rope_scaling_of(theirs)
    assert Config(path).torch_dtype() == torch.float32


@pytest.mark.parametrize("missing", ["tie_word_embeddings", "head_dim", "num_key_value_heads"])
def test_a_config_json_that_leaves_a_field_to_its_class_goes_through_autoconfig(tiny_qwen3, tmp_path, missing):
    from transformers import AutoConfig

    from minivllm.checkpoint import load_hf_config

    path = _copy_checkpoint(tiny_qwen3, tmp_path / "ckpt", drop=missing)
    ours = load_hf_config(path)
    assert type(ours) is type(AutoConfig.from_pretrained(tiny_qwen3))  # Qwen3Config: its defaults apply
    assert getattr(ours, missing) == getattr(type(ours)(), missing)


def test_the_tokenizer_given_our_config_is_the_one_autotokenizer_loads(tiny_qwen3, tmp_path):
    import json

    from transformers import AutoTokenizer

    from minivllm.checkpoint import load_hf_config, load_tokenizer

    text = "The capital of France is Paris."
    ref = AutoTokenizer.from_pretrained(tiny_qwen3)
    tok = load_tokenizer(tiny_qwen3, load_hf_config(tiny_qwen3))
    assert type(tok) is type(ref) and tok(text).input_ids == ref(text).input_ids
    path = _copy_checkpoint(tiny_qwen3, tmp_path / "ckpt")  # no class named: AutoTokenizer chooses, as before
    cfg = tmp_path / "ckpt" / "tokenizer_config.json"
    cfg.write_text(json.dumps({k: v for k, v in json.loads(cfg.read_text()).items() if k != "tokenizer_class"}))
    tok = load_tokenizer(path, load_hf_config(path))
    assert type(tok) is type(AutoTokenizer.from_pretrained(path)) and tok(text).input_ids == ref(text).input_ids


def test_the_engine_does_not_import_transformers_model_config_classes(tiny_qwen3):
    """What the README's first command skips (~1 s on a 2-core CPU): transformers' model-specific configuration
    classes, which import its activations module to validate hidden_act (and torch.distributed.tensor with it)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from minivllm import LLM, SamplingParams\n"
        f"llm = LLM({tiny_qwen3!r}, device='cpu', max_model_len=64)\n"
        "out = llm.generate(['hello'], SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "loaded = [m for m in sys.modules if m == 'transformers.activations' or m.endswith('.configuration_qwen3')]\n"
        "print(len(out[0].outputs[0].token_ids), sorted(loaded))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "2 []"
