"""Building the CPU operators (kernels/cpu/csrc/: RMSNorm, RoPE, SiLU-mul, the KV-cache store and paged decode
attention as one small C++ library of torch operators; ops.py loads them).

The library is compiled once per machine (`python3 -m minivllm.kernels.cpu.build`, ~20 s; `scripts/setup.sh` runs
it) with the system's C++ compiler against the installed torch, for this CPU (-march=native), into
`<cache>/cpu_ops/<key>/` (the key: the sources, torch's version, the compilers and the CPU's flags), and kept only
if it passes a self-test in a fresh process (self_test.py): each operator against its torch definition, and an
error raised inside it arriving as a Python ValueError. An engine never compiles it: without a built library (or
with the `cpu_ops` kernel option off) the CPU runs the torch ops, and a CPU engine's log says which."""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

import torch

from minivllm.kernels.cache import cache_root

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = [os.path.join(CSRC, name) for name in ("cpu_ops.h", "elementwise.cpp", "paged_decode.cpp")]
SELF_TEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "self_test.py")  # in the key: a build is kept
# only after it passed this self-test, so an edited self-test checks the library again
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
    """Where this machine's build lives: one directory per (sources and self-test, torch, compilers, CPU)
    combination."""
    parts = []
    for source in [*SOURCES, SELF_TEST]:
        with open(source, "rb") as fh:
            parts.append(fh.read())
    parts += [torch.__version__, _cpu_flags(), " ".join(FLAGS), *compilers()]
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
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()] + [s for s in SOURCES if s.endswith(".cpp")]
    cmd += ["-o", out]
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
    test = [sys.executable, "-m", "minivllm.kernels.cpu.self_test", out]
    check = subprocess.run(test, capture_output=True, text=True)
    if check.returncode:
        tail = (check.stdout + check.stderr)[-3000:]
        return f"built, but failed the self-test (exit status {check.returncode}):\n{tail}"
    return None


if __name__ == "__main__":  # python3 -m minivllm.kernels.cpu.build [--path]: build for this machine, print the path
    if "--path" in sys.argv:
        print(library_path())
        sys.exit(0)
    try:
        print(build(verbose="-v" in sys.argv))
    except (RuntimeError, OSError) as e:  # no compiler, or it failed: the engine runs the torch ops
        print(f"minivllm: the CPU ops were not built; the CPU runs the torch ops: {e}", file=sys.stderr)
        sys.exit(1)
