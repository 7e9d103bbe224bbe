"""The CPU twins of the GPU path's Triton kernels, with the torch definitions' signatures: RMSNorm (plain and
with the residual add), RoPE, SiLU-mul, the KV-cache store and paged decode attention, each one call into the C++
library (csrc/, built by build.py) instead of the ~5-15 torch ops (casts, elementwise passes, gathers) each of
them is on CPU. Each computes what the torch definition it stands in for computes (those stay in layers/:
notebooks 01-03 and 06-08 build them, tests/test_cpu_ops.py checks each operator against them). The library is
loaded once per process, the first time an engine asks (`loaded`); GPUs never see any of it."""

import logging
import os
import threading

import torch

from minivllm.kernels import torch_attention
from minivllm.kernels.cpu.build import library_path

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "reason": why not; filled once per process (the ops are global)


def loaded() -> bool:
    """The library's operators are registered in this process (loading this machine's build the first time)."""
    if "loaded" not in _state:
        with _lock:
            if "loaded" not in _state:
                _state["loaded"], _state["reason"] = _load()
    return bool(_state["loaded"])


def _load() -> tuple[bool, str]:
    try:
        path = library_path()
    except OSError as e:
        return False, f"the C++ source is missing ({e})"
    if not os.path.isfile(path):
        return False, "not built on this machine (python3 -m minivllm.kernels.cpu.build builds them, ~20 s)"
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as e:
        return False, f"{path} did not load ({e})"
    return True, ""


def not_loaded_reason() -> str:
    loaded()
    return str(_state.get("reason", ""))


def log_choice(wanted: bool) -> None:
    """One line in a CPU engine's log saying which small ops its steps run (`wanted`: the `cpu_ops` option)."""
    if not wanted:
        logger.info("CPU ops: torch (the cpu_ops kernel option is off)")
    elif loaded():
        logger.info("CPU ops: the C++ library (%s)", library_path())
    else:
        logger.info("CPU ops: torch; the C++ library is %s", not_loaded_reason())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.minivllm.rms_norm(x.contiguous(), weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.minivllm.add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)


def rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.minivllm.rotary(positions, query, key, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.minivllm.silu_and_mul(x.contiguous())


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    torch.ops.minivllm.store_kvcache(key, value, k_cache, v_cache, slot_mapping)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    lens, tables = context_lens.to(torch.int32), block_tables.to(torch.int32)  # no copy when they are int32
    return torch.ops.minivllm.paged_decode(q.contiguous(), k_cache, v_cache, lens, tables, scale)


def checked_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """paged_decode after the torch path's shape checks (their messages), what the engine's table holds."""
    torch_attention.check_paged_shapes(q, k_cache, v_cache, context_lens, block_tables, decode=True)
    return paged_decode(q, k_cache, v_cache, context_lens, block_tables, scale)
