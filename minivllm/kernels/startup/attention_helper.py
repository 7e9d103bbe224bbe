"""The helper process that compiles FlashAttention-4's prefill kernel beside a GPU engine's start
(attention_compile.py says when and why): it imports torch and FlashAttention-4, then waits on its stdin for one
stand-in prefill (JSON), runs it, which exports the kernel to FlashAttention-4's disk cache, and exits. Its
program is attention_compile.py's `main`."""

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HELPER_ENV = "MINIVLLM_ATTENTION_HELPER"  # set in a helper's environment
HELPER_IDLE_S = 300.0  # a helper whose engine sent nothing by then exits
HELPER_WAIT_S = 600.0  # an engine waits this long for its helper's compile at most
NO_REQUEST = 3  # a helper's exit status when no request came (idle too long, or its stdin closed)


@dataclass
class Helper:
    """A helper process: it imports torch and FlashAttention-4, then waits on its stdin for one stand-in."""

    process: subprocess.Popen
    log: object  # its stdout and stderr (a temporary file)
    cache_dir: str  # FlashAttention-4's disk cache it will export to (its environment's)

    def waiting(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        for f in (self.process.stdin, self.log):
            if not f.closed:
                f.close()

    def cancel(self) -> None:
        """Stop it (no engine wants its kernel: another backend, or a start-up that failed)."""
        if self.waiting():
            self.process.kill()
        self.process.wait()
        self.close()


def spawn_helper(idle_s: float = HELPER_IDLE_S, cache_dir: str | None = None) -> Helper:
    """A helper process: it imports, then waits on its stdin for one stand-in, `idle_s` seconds at most.
    `cache_dir`: FlashAttention-4's disk cache it exports to (its environment's)."""
    env = dict(os.environ, **{HELPER_ENV: "1"})  # the disk cache's variables included (fa4_cache_env)
    package_root = str(Path(__file__).resolve().parents[3])  # the directory holding minivllm/
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
    log = tempfile.TemporaryFile()  # noqa: SIM115 (the helper writes it until it exits; Helper.close closes it)
    process = subprocess.Popen(
        [sys.executable, "-m", "minivllm.kernels.startup.attention_compile", str(idle_s)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return Helper(process, log, cache_dir)
