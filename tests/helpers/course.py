"""The course's checks, shared: comparisons whose message names the exercise and shows what differs, and
`check("NN")`, which a notebook's last cells call to run chapter NN's checks (tests/course/) against the package
that notebook imports.

Tolerances come from the reference's own error, never a fixed 1e-5: in fp32 a result may be off the fp64 truth by
at most a few times what the same formula in fp32 is off (`oracle`); in bf16 (whose rounding is 100x coarser than
any fp32 slip) a result must equal the fp64 truth rounded once to bf16, as the engine's functions do by working in
fp32 and casting once, on all but a few elements (near-ties), and never by more than one bf16 step there.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # the aten ops a call runs (no public alias)

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16]
# where the chapters' Triton kernels run: natively on a GPU, through Triton's interpreter on a CPU (the interpreter
# is only switched on without CUDA, so on a GPU machine a kernel given CPU tensors would fail)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEAR_TIES = 0.01  # bf16: share of elements allowed one step off the once-rounded truth


def where(diff: torch.Tensor) -> str:
    """The first index (in row-major order) where `diff` is True."""
    idx = diff.nonzero()[0].tolist()
    return str(tuple(idx)) if len(idx) > 1 else str(idx[0])


def shapes_match(got, expected: torch.Tensor, exercise: str, what: str) -> None:
    assert isinstance(got, torch.Tensor), f"{exercise}: {what}: expected a tensor, got {type(got).__name__}"
    assert tuple(got.shape) == tuple(expected.shape), (
        f"{exercise}: {what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    )


def assert_exact(got, expected: torch.Tensor, exercise: str, what: str) -> None:
    """Integers, tokens, slots: equal everywhere; the message shows the first differing index."""
    if not isinstance(got, torch.Tensor):
        got = torch.as_tensor(got)
    shapes_match(got, expected, exercise, what)
    diff = got.to(expected.dtype) != expected
    if diff.any():
        i = diff.nonzero()[0]
        raise AssertionError(
            f"{exercise}: {what}: {int(diff.sum())} of {diff.numel()} differ; first at index {where(diff)}: "
            f"expected {expected[tuple(i)].item()}, got {got[tuple(i)].item()}"
        )


def assert_close(
    got, exact: torch.Tensor, exercise: str, what: str, oracle: torch.Tensor | None = None, dtype=None
) -> None:
    """`got` against the fp64 truth `exact`. fp32: within 4x the largest error of `oracle` (the same formula in
    fp32; default: the truth rounded to fp32) plus 1e-6 of the largest value. bf16: the truth rounded once to
    bf16 everywhere but NEAR_TIES of the elements, which may be one bf16 step off; where `oracle` (the reference's
    formula in bf16) rounds more, by as much as it does, or by 4x its largest error where that is more."""
    shapes_match(got, exact, exercise, what)
    dtype = dtype or got.dtype
    assert got.dtype == dtype, f"{exercise}: {what}: expected dtype {dtype}, got {got.dtype}"
    assert torch.isfinite(got).all(), (
        f"{exercise}: {what}: not finite at index {where(~torch.isfinite(got))} (expected finite values)"
    )
    g, e = got.double(), exact.double()
    if dtype == torch.bfloat16:
        rounded = e.to(torch.bfloat16).double()
        step = (rounded.abs() * 2.0**-7).clamp_min(2.0**-133)  # one bf16 step at each value
        steps = lambda t: ((t - rounded).abs() / step).max().item()
        share = lambda t: (t != rounded).double().mean().item()
        # the reference's own rounding sets the bar where its formula rounds more than once (F.silu(g) * u)
        max_steps = max(1.01, 1.01 * steps(oracle.double())) if oracle is not None else 1.01
        max_share = max(NEAR_TIES, 2 * share(oracle.double())) if oracle is not None else NEAR_TIES
        off = g != rounded
        far = (g - rounded).abs() > step * max_steps
        if oracle is not None:  # a sum whose terms cancel: its error scales with the terms, not with the result
            far &= (g - e).abs() > 4 * (oracle.double() - e).abs().max().item()
        if far.any() or share(g) > max_share:
            bad = far if far.any() else off
            i = tuple(bad.nonzero()[0].tolist())
            raise AssertionError(
                f"{exercise}: {what} (bf16): {int(off.sum())} of {off.numel()} elements differ from the truth "
                f"rounded once to bf16 (allowed: {max_share:.1%}, {max_steps:.2g} steps each); first at index {i}: "
                f"expected {rounded[i].item():.6g}, got {g[i].item():.6g} (fp64 truth {e[i].item():.8g}). "
                "Work in fp32 and cast once at the end."
            )
        return
    oracle = oracle if oracle is not None else e.to(dtype)
    tol = 4 * (oracle.double() - e).abs().max().item() + 1e-6 * e.abs().max().item()
    err = (g - e).abs()
    if (err > tol).any():
        i = tuple((err > tol).nonzero()[0].tolist())
        raise AssertionError(
            f"{exercise}: {what} ({str(dtype).removeprefix('torch.')}): max error {err.max().item():.3e} against "
            f"fp64 > {tol:.3e} (4x the reference's own); first at index {i}: expected {e[i].item():.8g}, "
            f"got {g[i].item():.8g}"
        )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def odd_size(gen: torch.Generator, low: int, high: int) -> int:
    """A random size in [low, high) that is not a power of two."""
    while True:
        n = int(torch.randint(low, high, (1,), generator=gen))
        if n & (n - 1):
            return n


# --- a notebook's check cell -------------------------------------------------------------------------------------

SUMMARY = re.compile(r"(\d+) (passed|failed|error|errors|skipped)")


def check(chapter: str, timeout: float = 600) -> None:
    """Runs chapter `chapter`'s course checks (tests/course, `-k chapter`) against the minivllm this process
    imports (the learner's in exercises/, the reference in notebooks/), in a fresh process; prints one stable
    line, or raises AssertionError with the failures."""
    import minivllm

    edition = Path(minivllm.__file__).resolve().parent.parent
    env = dict(os.environ, MINIVLLM_EDITION=str(edition))
    env["PYTHONPATH"] = os.pathsep.join([str(edition), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "course")]
    result = subprocess.run(
        [*cmd, "-k", f"test_{chapter}_", "--tb=line", "-rfE"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    counts = {kind: int(n) for n, kind in SUMMARY.findall(result.stdout.splitlines()[-1] if result.stdout else "")}
    passed = counts.get("passed", 0)
    if result.returncode != 0 or not passed:
        failures = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "E "))]
        raise AssertionError(
            f"chapter {chapter}: {passed} checks passed, not all:\n"
            + "\n".join(failures[:20] or [result.stdout[-3000:]])
        )
    total = passed + counts.get("skipped", 0)  # (skipped: GPU-only checks on a CPU; the line stays the same)
    print(f"chapter {chapter} checks OK: {total} checks, none failed")


class expect_error:
    """`with expect_error(ValueError, "RowParallelLinear.weight_loader", "a checkpoint too wide"):` fails with a
    message naming the exercise when the block raises nothing (or something else)."""

    def __init__(self, kind: type[BaseException], exercise: str, what: str) -> None:
        self.kind, self.exercise, self.what = kind, exercise, what

    def __enter__(self) -> "expect_error":
        return self

    def __exit__(self, kind, value, tb) -> bool:
        if kind is not None and issubclass(kind, self.kind):
            return True
        if kind is not None and issubclass(kind, NotImplementedError | AssertionError):
            return False
        got = "nothing" if kind is None else f"{kind.__name__}: {value}"
        raise AssertionError(f"{self.exercise}: {self.what}: expected a {self.kind.__name__}, got {got}") from value


def raised_in(tb, package_dir: str) -> str | None:
    """The innermost function of the package in a traceback (where a learner's code raised), as
    `qualname (path:line)`, or None."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.startswith(package_dir):
            name = getattr(code, "co_qualname", code.co_name)
            found = f"{name} ({code.co_filename[len(package_dir) - len('minivllm') :]}:{tb.tb_lineno})"
        tb = tb.tb_next
    return found


class HostSyncs(TorchDispatchMode):
    """Records the aten ops of a call that need the host to learn a value computed on the device: reading a
    scalar back (`_local_scalar_dense`, behind `bool(t)` and `.item()`), and ops whose output size depends on the
    data (`nonzero`, indexing with a boolean mask). A CUDA graph cannot hold any of them."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "nonzero", "masked_select"):
            self.found.append(name)
        elif name in ("index", "index_put_", "index_put"):
            masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
            if masks:
                self.found.append(f"{name} with a boolean mask")
        return func(*args, **(kwargs or {}))
