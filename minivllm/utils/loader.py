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
    packed_modules_mapping = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model, "tie_word_embeddings", False)
    expected = {(name, None) for name in params if not (tied and name == "lm_head.weight")}
    for name in params:  # packed parameters expect one load per shard
        for packed, shard_id in packed_modules_mapping.values():
            if f".{packed}." in f".{name}":
                expected.discard((name, None))
                expected.add((name, shard_id))
    loaded = set()
    files = checkpoint_files(path)
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for weight_name in f.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                if weight_name.endswith(IGNORED_SUFFIXES) or (tied and weight_name == "lm_head.weight"):
                    continue
                param_name, shard_id = weight_name, None
                for k, (packed, sid) in packed_modules_mapping.items():
                    if f".{k}." in weight_name:
                        param_name, shard_id = weight_name.replace(f".{k}.", f".{packed}."), sid
                        break
                if param_name not in params:
                    raise KeyError(
                        f"unexpected tensor {weight_name!r} in {file}: the model has no parameter {param_name!r}"
                    )
                param = params[param_name]
                weight_loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    if shard_id is None:
                        weight_loader(param, f.get_tensor(weight_name))
                    else:
                        weight_loader(param, f.get_tensor(weight_name), shard_id)
                except ValueError as e:
                    raise ValueError(f"tensor {weight_name!r} in {file}: {e}") from None
                loaded.add((param_name, shard_id))
    missing = sorted(checkpoint_name(n, s, packed_modules_mapping) for n, s in expected - loaded)
    if missing:
        raise KeyError(f"tensors {missing} are missing from the checkpoint files {files}")


def checkpoint_name(param_name: str, shard_id, packed_modules_mapping: dict) -> str:
    """The checkpoint tensor that fills (param_name, shard_id): qkv_proj + "k" -> k_proj."""
    for k, (packed, sid) in packed_modules_mapping.items():
        if sid == shard_id and f".{packed}." in f".{param_name}":
            return param_name.replace(f".{packed}.", f".{k}.")
    return param_name
