"""A tensor-parallel worker that dies while the engine starts (minivllm/engine/tp_workers.py) ends the
engine's construction within seconds with an error naming its rank, and leaves no process behind: a TP=2
script fed on standard input (the spawned worker cannot re-import __main__ and exits), a worker that raises
an out-of-memory error while loading."""

import os
import subprocess
import sys
import textwrap

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = "LLM({model!r}, tensor_parallel_size=2, num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=64)"


def run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # a parent that waited forever would hit this timeout; the error comes in seconds (start-up of 2 processes)
    return subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, env=env, timeout=180, cwd=ROOT
    )


def no_worker_left(stdout: str) -> None:
    for line in stdout.splitlines():
        if line.startswith("worker pids:"):
            pids = [int(p) for p in line.split(":")[1].split()]
            assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


@pytest.mark.slow
def test_script_on_stdin_fails_fast_naming_the_rank(tiny_qwen3):
    script = f"from minivllm import LLM\nllm = {ENGINE.format(model=tiny_qwen3)}\nprint('constructed')\n"
    result = run(["-"], stdin=script)
    assert result.returncode != 0 and "constructed" not in result.stdout
    assert "WorkerError: tensor-parallel worker rank 1 exited (exit code 1) before started" in result.stderr
    assert "spawned workers re-import __main__, which is not a file here ('<stdin>')" in result.stderr


DRIVER = textwrap.dedent("""
    from minivllm.engine import model_runner

    if __name__ == "__mp_main__":  # the spawned worker re-imports this file under that name: break it there
        def load_model(self):
            raise MemoryError("CUDA out of memory while loading (simulated)")
        model_runner.ModelRunner.load_model = load_model

    if __name__ == "__main__":
        from minivllm.engine import tp_workers
        from minivllm import LLM
        start = tp_workers.Workers.__init__
        def spy(self, *a, **k):
            start(self, *a, **k)
            print("worker pids:", *[p.pid for p in self.processes], flush=True)
        tp_workers.Workers.__init__ = spy
        llm = ENGINE
        print("constructed")
""")


@pytest.mark.slow
def test_worker_out_of_memory_while_loading_names_its_rank(tiny_qwen3, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.replace("ENGINE", ENGINE.format(model=tiny_qwen3)))
    result = run([str(driver)])
    assert result.returncode != 0 and "constructed" not in result.stdout
    message = "rank 1 failed (phases done: started): MemoryError: CUDA out of memory while loading (simulated)"
    assert message in result.stderr, result.stderr[-2000:]
    no_worker_left(result.stdout)
