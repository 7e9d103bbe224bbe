"""Where minivllm keeps what it builds once per machine: the CPU operators (kernels/cpu/build.py), FlashAttention-4's
compiled kernels (kernels/flash_attention.py) and the embedded default model, converted (frontend/default_model.py)."""

import os


def cache_root() -> str:
    """$MINIVLLM_CACHE, else $XDG_CACHE_HOME/minivllm, else ~/.cache/minivllm."""
    if os.environ.get("MINIVLLM_CACHE"):
        return os.environ["MINIVLLM_CACHE"]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "minivllm")
