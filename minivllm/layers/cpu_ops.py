"""The CPU twins of the GPU path's Triton kernels: RMSNorm (plain and with the residual add), RoPE, SiLU-mul,
the KV-cache store and paged decode attention as one small C++ library of torch operators
(`minivllm/csrc/cpu_ops.cpp`). Each computes what the torch definition it stands in for computes (those stay:
notebooks 01-03 and 06-08 build them, tests/test_cpu_ops.py checks each operator against them), in one call
instead of the ~5-15 torch ops (casts, elementwise passes, gathers) each of them is on CPU. Measured on the 2-core
development machine: benchmarks/NOTES.md, change 29.

The library is compiled once per machine (`python3 -m minivllm.layers.cpu_ops`, ~20 s; `scripts/setup.sh` runs
it) with the system's C++ compiler against the installed torch, for this CPU (-march=native), into
`<cache>/cpu_ops/<key>/` (the key: the source, torch's version, the compilers and the CPU's flags), and kept only
if it passes a self-test in a fresh process: each operator against its torch definition, and an error raised inside
it arriving as a Python ValueError. An engine never compiles it: without a built library (or with
MINIVLLM_CPU_OPS=0) the CPU runs the torch ops, as before, and a CPU engine's log says which. GPUs never see any
of it."""

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import torch

from minivllm.utils.default_model import cache_root
from minivllm.utils.switches import SWITCHES

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "cpu_ops.cpp")
LIBRARY = "libminivllm_cpu_ops.so"
FLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-fopenmp",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-w",
]


def compilers() -> list[str]:
    """The C++ compilers to try, in order: $CXX, then the system's c++ and g++, each once. (A $CXX whose C++ runtime
    differs from torch's builds a library that crashes on an error; its self-test rejects it, the next is tried.)"""
    names = [c for c in (os.environ.get("CXX"), shutil.which("c++"), shutil.which("g++")) if c]
    seen, out = set(), []
    for c in names:
        real = os.path.realpath(shutil.which(c) or c)
        if real not in seen:
            seen.add(real)
            out.append(c)
    return out or ["c++"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path() -> str:
    """Where this machine's build lives: one directory per (source, torch, compilers, CPU) combination."""
    with open(SOURCE, "rb") as fh:
        parts = [fh.read(), torch.__version__, _cpu_flags(), " ".join(FLAGS), *compilers()]
    key = hashlib.sha256(b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)).hexdigest()[:16]
    return os.path.join(cache_root(), "cpu_ops", key, LIBRARY)


def build(verbose: bool = False) -> str:
    """Compile the library unless this machine's build exists, with the first compiler whose build passes the
    self-test; returns its path. Raises with each compiler's failure if none does."""
    path = library_path()
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    failures = []
    for cxx in compilers():
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
            out = os.path.join(tmp, LIBRARY)
            failure = _compile_and_check(cxx, out, verbose)
            if failure is None:
                os.replace(out, path)  # atomic: a concurrent build or load sees the whole file or none
                return path
            failures.append(f"{cxx}: {failure}")
    raise RuntimeError("no compiler built CPU ops that pass their self-test:\n" + "\n".join(failures))


def _compile_and_check(cxx: str, out: str, verbose: bool) -> str | None:
    """Build with `cxx` into `out`; None if it built and passed the self-test, else what went wrong."""
    from torch.utils import cpp_extension  # only here: importing it costs ~0.3 s

    libs = cpp_extension.library_paths()
    cmd = [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()] + [SOURCE, "-o", out]
    # torch's own libgomp comes first: the process then has one OpenMP runtime, torch's thread pool
    cmd += [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs] + ["-lc10", "-ltorch_cpu", "-ltorch"]
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        return f"did not run ({e})"
    if done.returncode:
        return f"the compile failed:\n{done.stderr[-3000:]}"
    # in a fresh process, before any engine may load it: its results against the torch definitions, and an error
    # raised inside it arriving as a Python ValueError (a library whose C++ runtime cannot unwind into torch's
    # crashes the process on a bad input instead)
    test = [sys.executable, "-m", "minivllm.layers.cpu_ops", "--self-test", out]
    check = subprocess.run(test, capture_output=True, text=True)
    if check.returncode:
        tail = (check.stdout + check.stderr)[-3000:]
        return f"built, but failed the self-test (exit status {check.returncode}):\n{tail}"
    return None


def self_test(path: str) -> None:
    """Load the library at `path` and check each operator on small inputs against the torch definition, and
    that a bad input raises ValueError; raises AssertionError otherwise (python3 -m ... --self-test PATH)."""
    import torch.nn.functional as F

    from minivllm.layers import layernorm, rotary_embedding, torch_attention

    torch.ops.load_library(path)
    ops = torch.ops.minivllm
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g), torch.rand(64, generator=g) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), layernorm.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(ops.add_rms_norm(x, r, w, 1e-6)[0], layernorm.rms_norm(x + r, w, 1e-6))
    gate_up = torch.randn(3, 128, generator=g)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate_up[:, :64]) * gate_up[:, 64:])
    rope = rotary_embedding.RotaryEmbedding(64, 64, 16, 10000.0)
    q, k, pos = torch.randn(3, 4, 64, generator=g), torch.randn(3, 2, 64, generator=g), torch.tensor([0, 5, 15])
    for got, want in zip(ops.rotary(pos, q, k, rope.cos_sin_cache), rope.rotate(pos, q, k)):
        torch.testing.assert_close(got, want)
    k_cache, v_cache = torch.zeros(2, 4, 2, 64), torch.zeros(2, 4, 2, 64)
    ops.store_kvcache(k[:2], k[1:], k_cache, v_cache, torch.tensor([5, 2]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[0, 2], k[2])
    lens, tables = torch.tensor([6, 3], dtype=torch.int32), torch.tensor([[1, 0], [0, -1]], dtype=torch.int32)
    want = torch_attention.paged_decode_attention(q[:2], k_cache, v_cache, lens, tables, 0.125)
    torch.testing.assert_close(ops.paged_decode(q[:2], k_cache, v_cache, lens, tables, 0.125), want)
    try:
        ops.rotary(torch.tensor([0, 5, 16]), q, k, rope.cos_sin_cache)
    except ValueError as e:
        assert "position 16 outside" in str(e), e
    else:
        raise AssertionError("a position past the table raised nothing")


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
        return False, "not built on this machine (python3 -m minivllm.layers.cpu_ops builds them, ~20 s)"
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as e:
        return False, f"{path} did not load ({e})"
    return True, ""


def not_loaded_reason() -> str:
    loaded()
    return str(_state.get("reason", ""))


def runs_on(x: torch.Tensor) -> bool:
    """The C++ operators take tensor `x`: on CPU, the `cpu_ops` switch on (MINIVLLM_CPU_OPS), not asked for
    torch.compile (MINIVLLM_COMPILE=1) or eager torch (=0), and the library built and loaded."""
    return x.device.type == "cpu" and SWITCHES.cpu_ops and SWITCHES.compile is None and loaded()


def log_choice(device: torch.device | str) -> None:
    """One line in an engine's log saying which small ops its CPU steps run."""
    if torch.device(device).type != "cpu":
        return
    if not SWITCHES.cpu_ops:
        logger.info("CPU ops: torch (MINIVLLM_CPU_OPS=0)")
    elif loaded():
        logger.info("CPU ops: the C++ library (%s)", library_path())
    else:
        logger.info("CPU ops: torch; the C++ library is %s", not_loaded_reason())


# --- the operators, with the torch definitions' signatures ------------------------------------------------------


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


if __name__ == "__main__":  # python3 -m minivllm.layers.cpu_ops [--path]: build for this machine, print the path
    if "--path" in sys.argv:
        print(library_path())
        sys.exit(0)
    if "--self-test" in sys.argv:
        self_test(sys.argv[sys.argv.index("--self-test") + 1])
        sys.exit(0)
    try:
        print(build(verbose="-v" in sys.argv))
    except (RuntimeError, OSError) as e:  # no compiler, or it failed: the engine runs the torch ops
        print(f"minivllm: the CPU ops were not built; the CPU runs the torch ops: {e}", file=sys.stderr)
        sys.exit(1)
