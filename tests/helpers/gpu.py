"""What the GPU cells of the notebooks and the GPU checks share: which FlashAttention backends can run here,
and the rule that a GPU run never passes by skipping them.

On a GPU box without FlashAttention a notebook's GPU cell falls back to what is there and says so. The GPU
check (`scripts/gpu_check.sh`) and the GPU CI job (`.github/workflows/gpu.yml`) set MINIVLLM_REQUIRE_FA4=1:
then, with a GPU present, a FlashAttention-4 that does not import (or a GPU older than SM90, where it cannot
run) is an error naming the cause, in every notebook cell that asks and at the start of a pytest session
(the repository's conftest.py), instead of a quiet fallback to the torch backend."""

import os

import torch

from minivllm.kernels import attention_backends

REQUIRE_FA4 = "MINIVLLM_REQUIRE_FA4"


def fa4_required() -> bool:
    """True when MINIVLLM_REQUIRE_FA4=1 (anything other than 0/1/unset is an error, not a silent no)."""
    value = os.environ.get(REQUIRE_FA4, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{REQUIRE_FA4} must be 0 or 1, got {value!r}")
    return value == "1"


def why_no_fa4() -> str | None:
    """None if FlashAttention-4 runs on this machine's GPU, else why not (the import error itself)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"{torch.cuda.get_device_name()} is SM{major}{minor}; FlashAttention-4 needs SM90 or newer"
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: F401
    except Exception as e:  # ImportError, or a RuntimeError when its CUTLASS libraries are missing
        return f"`from flash_attn.cute import flash_attn_varlen_func` failed: {type(e).__name__}: {e}"
    return None


def skip_without_fa4() -> None:
    """Skip the calling GPU test where FlashAttention-4 cannot run (MINIVLLM_REQUIRE_FA4=1 makes that an error at the
    session's start instead)."""
    import pytest

    if "fa4" not in attention_backends.available("cuda"):
        pytest.skip("FlashAttention-4 is not available on this GPU")


def flash_backends() -> list[str]:
    """The FlashAttention backends usable on this machine's GPU ("fa4", "flash_attn"), fastest first; [] on a
    machine without CUDA. With a GPU and MINIVLLM_REQUIRE_FA4=1, raises unless "fa4" is among them."""
    if not torch.cuda.is_available():
        return []
    names = [b for b in attention_backends.available("cuda") if b != "torch"]
    if fa4_required() and "fa4" not in names:
        raise RuntimeError(f"{REQUIRE_FA4}=1 but FlashAttention-4 cannot run here: {why_no_fa4()}")
    return names


def require_gpus() -> int:
    """How many GPUs MINIVLLM_REQUIRE_GPUS asks for (0 when unset); raises when fewer are present, so a check
    meant for a two-GPU machine cannot pass on one GPU by taking its one-GPU branch."""
    need = int(os.environ.get("MINIVLLM_REQUIRE_GPUS", "0"))
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < need:
        raise RuntimeError(f"MINIVLLM_REQUIRE_GPUS={need} but this machine has {have} GPU(s)")
    return need
