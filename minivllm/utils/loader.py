"""Load a Hugging Face checkpoint (config.json + one or many *.safetensors, with or without an index)
into our packed model through each parameter's weight_loader, sharded for this TP rank. Every problem
(missing file, missing or unexpected tensor, wrong shape) is an error naming the tensor and the file."""

import json
import os
from glob import glob

import torch
from safetensors import safe_open
from torch import nn

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(
            f"checkpoint shape {tuple(loaded_weight.shape)} does not match parameter shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise FileNotFoundError(f"{index} lists {missing}, missing from {path}")
        return [os.path.join(path, n) for n in names]
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def load_model(model: nn.Module, path: str) -> None:
    """Fill every parameter of `model` from the checkpoint: a tensor packed into a larger parameter (q_proj into
    qkv_proj, `packed_modules_mapping`) goes through that parameter's weight_loader with its shard id."""
    mapping = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model, "tie_word_embeddings", False)
    expected = {t for name in params if not (tied and name == "lm_head.weight") for t in tensors_of(name, mapping)}
    files = checkpoint_files(path)
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for weight_name in f.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                if weight_name.endswith(IGNORED_SUFFIXES) or (tied and weight_name == "lm_head.weight"):
                    continue
                param_name, shard = weight_name, ()
                for k, (packed, shard_id) in mapping.items():
                    if f".{k}." in weight_name:
                        param_name, shard = weight_name.replace(f".{k}.", f".{packed}."), (shard_id,)
                        break
                if param_name not in params:
                    raise KeyError(
                        f"unexpected tensor {weight_name!r} in {file}: the model has no parameter {param_name!r}"
                    )
                param = params[param_name]
                weight_loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    weight_loader(param, f.get_tensor(weight_name), *shard)  # a packed parameter's with its shard id
                except ValueError as e:
                    raise ValueError(f"tensor {weight_name!r} in {file}: {e}") from None
                expected.discard(weight_name)
    if expected:
        raise KeyError(f"tensors {sorted(expected)} are missing from the checkpoint files {files}")


def tensors_of(param_name: str, mapping: dict) -> list[str]:
    """The checkpoint tensors that fill a parameter: qkv_proj -> q_proj, k_proj, v_proj; others their own name."""
    packed = [param_name.replace(f".{p}.", f".{k}.") for k, (p, _) in mapping.items() if f".{p}." in f".{param_name}"]
    return packed or [param_name]
