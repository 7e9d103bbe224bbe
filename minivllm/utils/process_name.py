"""The name `ps` and `top` show for a process of the engine (vLLM names its engine core the same way): the
engine core, the tensor-parallel workers and the tokenizer pool's workers are otherwise all "python3".
benchmarks/bench_serve.py reads these names to tell the engine's CPU time from the API server's."""

CORE = "minivllm-core"  # the engine core process (serve/core.py)
TP_WORKER = "minivllm-tp"  # + the rank: a tensor-parallel worker (engine/tp_workers.py)
TOKENIZER = "minivllm-tok"  # a tokenizer pool worker of the API server (serve/tokenizer_pool.py)


def set_process_name(name: str) -> None:
    """Linux: the process's name in /proc (at most 15 characters); elsewhere nothing."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass
