"""Chapter 10: Qwen3Attention, Qwen3MLP, Qwen3DecoderLayer and Qwen3Model forwards (minivllm/models/qwen3.py) on a
tiny random Qwen3 checkpoint (sizes not powers of two), against transformers run in fp64: the last-token logits
of a packed prefill of three prompts, in fp32 and bf16, within the error transformers itself makes in that dtype."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from helpers.course import DTYPES, assert_close, seeded
from helpers.prefill import prefill_logits
from helpers.tiny_model import make_tiny_checkpoint
from minivllm.models.qwen3 import Qwen3ForCausalLM, Qwen3MLP
from minivllm.utils.loader import load_model

IDS = ["fp32", "bf16"]
MODEL = "Qwen3Attention.forward / Qwen3DecoderLayer.forward / Qwen3Model.forward"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    sizes = dict(hidden_size=60, intermediate_size=84, num_attention_heads=6, num_key_value_heads=3, head_dim=14)
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3_course")), "qwen3", **sizes)
    # RMSNorm weights of 1 (transformers' init) commute with RoPE's rotation: norm(rope(x)) == rope(norm(x)), so
    # an attention that rotates before its QK-norm would pass. Weights around 1 make every norm count.
    weights = Path(path) / "model.safetensors"
    tensors, gen = load_file(weights), seeded(72)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = (1 + 0.5 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    return path


def build(path: str, dtype) -> Qwen3ForCausalLM:
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Qwen3ForCausalLM(AutoConfig.from_pretrained(path))
    finally:
        torch.set_default_dtype(default)
    load_model(model, path)
    return model.eval()


def prompts(vocab: int) -> list[list[int]]:
    gen = seeded(70)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (11, 1, 23)]


@torch.inference_mode()
def hf_logits(path: str, dtype, ps: list[list[int]]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    return torch.stack([model(torch.tensor([p])).logits[0, -1] for p in ps])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_mlp(dtype):
    gen = seeded(71)
    mlp = Qwen3MLP(60, 84, "silu").to(dtype)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2, generator=gen)
    x = torch.randn(13, 60, generator=gen).to(dtype)
    w_gu, w_d = mlp.gate_up_proj.weight.double(), mlp.down_proj.weight.double()
    gate, up = (x.double() @ w_gu.T).chunk(2, dim=-1)
    exact = (gate * torch.sigmoid(gate) * up) @ w_d.T
    # the reference's own rounding: each projection accumulates in fp32 and rounds its output once to `dtype`
    g32, u32 = (x.float() @ w_gu.float().T).to(dtype).float().chunk(2, dim=-1)
    oracle = ((torch.nn.functional.silu(g32) * u32).to(dtype).float() @ w_d.float().T).to(dtype)
    assert_close(mlp(x), exact, "Qwen3MLP.forward", "down(silu(gate) * up)", oracle=oracle, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_model_logits(checkpoint, dtype):
    model = build(checkpoint, dtype)
    ps = prompts(model.lm_head.weight.shape[0])
    got = prefill_logits(model, ps)
    exact = hf_logits(checkpoint, torch.float64, ps)
    oracle = hf_logits(checkpoint, dtype, ps)  # transformers' own error in this dtype sets the bar
    assert_close(got, exact, MODEL, "last-token logits of a packed prefill", oracle=oracle, dtype=dtype)
