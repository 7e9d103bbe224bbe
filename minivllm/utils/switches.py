"""The kernel switches: which of our GPU kernels run. One place, one naming scheme.

Each field `name` is read once from the environment variable `MINIVLLM_<NAME>` (upper case), and can be
changed with `switches.set(name=value)`, or for a block with `with switches.override(name=value): ...`.
They are measurement and debugging knobs for the whole process, like `CUDA_LAUNCH_BLOCKING`: an engine's
`Config` never sets them (what differs between two engines in one process, the attention backend for
instance, travels in the `Config`). Spawned tensor-parallel workers inherit the environment, so set the
variable, not only the field, before starting a TP engine with a switch changed."""

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields

DECODE_KERNELS = ("triton", "flash")
ATTENTION_COMPILE = ("auto", "process", "thread", "off")


@dataclass(slots=True)
class Switches:
    decode_kernel: str = "triton"  # decode attention with a flash backend: "triton" (ours) or "flash" (its own)
    pdl: bool = True  # programmatic dependent launch between our Triton kernels (Hopper and later)
    fused_prologue: bool = True  # QK-norm + RoPE + KV-cache write in one Triton kernel (GPU)
    compile: bool | None = None  # small ops: None Triton on CUDA, True torch.compile, False eager (compile.py)
    cpu_packed_linear: bool = True  # CPU: linear layers through oneDNN with weights packed at load (cpu_linear.py)
    triton_on_cpu: bool = False  # CPU: run the GPU path's Triton kernels (store, prologue, sampler) interpreted
    cpu_ops: bool = True  # CPU: norms, RoPE, SiLU-mul, KV store, decode attention in C++ when built (cpu_ops.py)
    attention_compile: str = "auto"  # GPU start: where FlashAttention-4 compiles (engine/attention_compile.py)
    triton_compile: bool = True  # GPU start: our Triton kernels compile side by side on threads (triton_compile.py)

    def check(self) -> None:
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"unknown decode kernel {self.decode_kernel!r}; choose from {DECODE_KERNELS}")
        if self.attention_compile not in ATTENTION_COMPILE:
            raise ValueError(f"unknown attention_compile {self.attention_compile!r}; choose from {ATTENTION_COMPILE}")
        for name in ("pdl", "fused_prologue", "cpu_packed_linear", "triton_on_cpu", "cpu_ops", "triton_compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"switch {name} must be True or False, got {getattr(self, name)!r}")
        if self.compile not in (None, True, False):
            raise ValueError(f"switch compile must be None, True or False, got {self.compile!r}")


def env_name(name: str) -> str:
    return f"MINIVLLM_{name.upper()}"


def _parse(name: str, text: str):
    """An environment value for field `name`: "1"/"0" for flags, "" or "auto" for compile's None."""
    if name in ("decode_kernel", "attention_compile"):
        return text
    if name == "compile" and text in ("", "auto"):
        return None
    if text not in ("0", "1"):
        raise ValueError(f"{env_name(name)} must be 0 or 1, got {text!r}")
    return text == "1"


RENAMED = {"MINIVLLM_EARLY_ATTENTION_COMPILE": "MINIVLLM_ATTENTION_COMPILE (auto, process, thread or off)"}


def from_env() -> Switches:
    values = {
        f.name: _parse(f.name, os.environ[env_name(f.name)]) for f in fields(Switches) if env_name(f.name) in os.environ
    }
    for old, new in RENAMED.items():
        if old in os.environ:
            warnings.warn(f"{old} is no longer read; set {new}", stacklevel=2)
    switches = Switches(**values)
    switches.check()
    return switches


SWITCHES = from_env()


def triton_runs_on(t) -> bool:
    """Our Triton kernels take tensor `t`: on CUDA, or on CPU through the interpreter when `triton_on_cpu` asks
    for the GPU path there. The one rule every kernel's caller follows."""
    return t.is_cuda or SWITCHES.triton_on_cpu


def set(**values) -> None:
    """Change switches by name, e.g. `switches.set(pdl=False)`; unknown names and bad values raise."""
    names = {f.name for f in fields(Switches)}
    unknown = sorted(values.keys() - names)
    if unknown:
        raise ValueError(f"unknown switch(es) {unknown}; the switches are {sorted(names)}")
    old = {name: getattr(SWITCHES, name) for name in values}
    for name, value in values.items():
        setattr(SWITCHES, name, value)
    try:
        SWITCHES.check()
    except ValueError:
        for name, value in old.items():
            setattr(SWITCHES, name, value)
        raise


@contextmanager
def override(**values):
    """`with override(pdl=False): ...` sets switches for the block and restores them after."""
    old = {name: getattr(SWITCHES, name) for name in values if hasattr(SWITCHES, name)}
    set(**values)
    try:
        yield SWITCHES
    finally:
        set(**old)
