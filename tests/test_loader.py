"""minivllm/utils/loader.py: Hugging Face safetensors checkpoints in one file or many, with or without
model.safetensors.index.json, loaded into our packed parameters; every broken checkpoint is a clear error
naming the tensor and the file, and no parameter is ever left uninitialised."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.utils.loader import checkpoint_files, load_model

INDEX = "model.safetensors.index.json"
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def new_model(path: str) -> Qwen3ForCausalLM:
    """A fresh model whose every parameter is NaN, so anything the loader misses shows."""
    model = Qwen3ForCausalLM(AutoConfig.from_pretrained(path))
    for p in model.parameters():
        p.data.fill_(float("nan"))
    return model


def expected_parameters(model: Qwen3ForCausalLM, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameter name -> what it must hold, built from the checkpoint's unpacked tensors."""
    out = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        packed = next((p for p in PACKED if f".{p}." in name), None)
        if packed:
            out[name] = torch.cat([hf_state[name.replace(packed, part)] for part in PACKED[packed]])
        elif name == "lm_head.weight" and model.tie_word_embeddings:
            out[name] = hf_state["model.embed_tokens.weight"]
        else:
            out[name] = hf_state[name]
    return out


def assert_loaded(model: Qwen3ForCausalLM, reference_dir: str) -> None:
    hf_state = AutoModelForCausalLM.from_pretrained(reference_dir).state_dict()
    expected = expected_parameters(model, hf_state)
    for name, p in model.named_parameters(remove_duplicate=False):
        assert not p.isnan().any(), f"{name} was left uninitialised"
        assert torch.equal(p.data, expected[name]), f"{name} differs from the checkpoint"


def copy_checkpoint(src: str, dst) -> str:
    return shutil.copytree(src, str(dst))


def rewrite(file: str, change) -> None:
    """Apply `change(tensors)` to one safetensors file in place."""
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture
def sharded(tiny_qwen2, tmp_path) -> str:
    """tiny_qwen2 re-saved by transformers in small shards, with an index."""
    path = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(tiny_qwen2).save_pretrained(path, max_shard_size="100KB")
    return path


# --- layouts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen2", "tiny_llama"])
def test_one_file_without_index(fixture, request):
    path = request.getfixturevalue(fixture)
    assert [os.path.basename(f) for f in checkpoint_files(path)] == ["model.safetensors"]
    assert not os.path.exists(os.path.join(path, INDEX))
    model = new_model(path)
    load_model(model, path)
    assert_loaded(model, path)  # biases (qwen2), tied and untied heads


def test_many_files_with_index(sharded, tiny_qwen2):
    files = checkpoint_files(sharded)
    assert len(files) >= 3 and os.path.exists(os.path.join(sharded, INDEX))
    model = new_model(sharded)
    load_model(model, sharded)
    assert_loaded(model, tiny_qwen2)


def test_many_files_without_index(sharded, tiny_qwen2):
    os.remove(os.path.join(sharded, INDEX))
    assert len(checkpoint_files(sharded)) >= 3  # found by glob
    model = new_model(sharded)
    load_model(model, sharded)
    assert_loaded(model, tiny_qwen2)


def test_index_decides_which_files_are_read(sharded, tiny_qwen2):
    stray = os.path.join(sharded, "stale-copy.safetensors")  # a file the index does not list
    save_file({"model.something_else.weight": torch.zeros(3)}, stray)
    assert stray not in checkpoint_files(sharded)
    model = new_model(sharded)
    load_model(model, sharded)  # the stray tensor would be "unexpected"
    assert_loaded(model, tiny_qwen2)


# --- broken checkpoints --------------------------------------------------------------------------------


def test_file_listed_in_index_is_missing(sharded):
    with open(os.path.join(sharded, INDEX)) as f:
        victim = sorted(set(json.load(f)["weight_map"].values()))[1]
    os.remove(os.path.join(sharded, victim))
    with pytest.raises(FileNotFoundError) as e:
        load_model(new_model(sharded), sharded)
    assert victim in str(e.value) and INDEX in str(e.value)


def test_no_safetensors_at_all(tiny_qwen3, tmp_path):
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors") as e:
        load_model(new_model(path), path)
    assert path in str(e.value)


@pytest.mark.parametrize(
    "tensor",
    [
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.norm.weight",
        "model.embed_tokens.weight",
    ],
)
def test_missing_tensor(tiny_qwen3, tmp_path, tensor):
    path = copy_checkpoint(tiny_qwen3, tmp_path / "ckpt")
    file = os.path.join(path, "model.safetensors")
    rewrite(file, lambda t: t.pop(tensor))
    with pytest.raises(KeyError) as e:
        load_model(new_model(path), path)
    assert tensor in str(e.value) and file in str(e.value)


def test_missing_lm_head_of_untied_model(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    file = os.path.join(path, "model.safetensors")
    rewrite(file, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(KeyError, match="lm_head.weight"):
        load_model(new_model(path), path)


def test_unexpected_tensor(sharded):
    file = checkpoint_files(sharded)[-1]
    rewrite(file, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}))
    with pytest.raises(KeyError) as e:
        load_model(new_model(sharded), sharded)
    assert "model.layers.0.mlp.extra_proj.weight" in str(e.value) and file in str(e.value)


@pytest.mark.parametrize(
    "tensor, shape",
    [
        ("model.layers.0.self_attn.q_proj.weight", (64, 65)),  # packed (q of qkv), wrong input dim
        ("model.layers.0.self_attn.k_proj.weight", (40, 64)),  # packed, too many rows
        ("model.layers.0.self_attn.v_proj.bias", (31,)),  # packed bias, too short
        ("model.layers.1.mlp.gate_proj.weight", (129, 64)),  # packed (gate of gate_up)
        ("model.layers.1.mlp.down_proj.weight", (64, 130)),  # row-parallel, too many columns
        ("model.layers.1.self_attn.o_proj.weight", (65, 64)),  # row-parallel, too many rows
        ("model.embed_tokens.weight", (520, 64)),  # vocab-parallel, too many rows
        ("model.norm.weight", (63,)),  # plain parameter
    ],
)
def test_wrong_shape(tiny_qwen2, tmp_path, tensor, shape):
    path = copy_checkpoint(tiny_qwen2, tmp_path / "ckpt")
    file = os.path.join(path, "model.safetensors")
    rewrite(file, lambda t: t.update({tensor: torch.zeros(shape)}))
    with pytest.raises(ValueError) as e:
        load_model(new_model(path), path)
    assert tensor in str(e.value) and file in str(e.value) and str(tuple(shape)) in str(e.value)
