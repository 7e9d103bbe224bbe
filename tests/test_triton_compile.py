"""The Triton kernels a GPU engine compiles on threads at its start (minivllm/kernels/startup/triton_compile.py): the
stand-ins must launch the variants the engine's own launches need, so that nothing compiles on the runner's
thread. On CPU, through the Triton interpreter, by comparing what each launch would specialise on; on a GPU, in a
fresh process over an empty Triton cache, by which thread each compile ran on."""

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.kernels.startup import triton_compile

KERNELS = {  # the engine's Triton kernels on a GPU, by default (layers/)
    "_rms_norm_kernel",
    "_silu_mul_kernel",
    "attention_prologue_kernel",
    "paged_decode_kernel",
    "combine_splits_kernel",
    "cdf_tiles_kernel",
    "cdf_pick_kernel",
}


def kind(value, specialised: bool = True):
    """What Triton compiles a separate variant for, of a runtime argument: a tensor's dtype, an integer's being 1
    or a multiple of 16 (unless the kernel says not to specialise on it). (Alignment: every tensor here starts
    where torch's allocator puts it, 16-byte aligned, as the engine's step inputs do: step_inputs.ALIGN.)"""
    if isinstance(value, torch.Tensor):
        return str(value.dtype)
    if isinstance(value, int) and not isinstance(value, bool):
        return ("int", value == 1, value % 16 == 0) if specialised else "int"
    return type(value).__name__


@contextlib.contextmanager
def launches_recorded():
    """The set of (kernel, argument kinds, constants) launched in the block, through the Triton interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    seen, run = set(), InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        plain = set(self.kwargs.get("do_not_specialize") or ())
        names = self.arg_names[: len(args)]
        kinds = tuple(kind(a, name not in plain) for name, a in zip(names, args))
        seen.add((self.fn.__name__, kinds, tuple(sorted(kwargs.items()))))  # constants and launch options
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recorded
    try:
        yield seen
    finally:
        InterpretedFunction.run = run


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the Triton interpreter runs only without CUDA (minivllm/__init__.py)"
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_stand_ins_launch_every_variant_the_engine_launches(tiny_qwen3, dtype, monkeypatch):
    """A CPU engine running the GPU path's kernels through the interpreter (the `triton_on_cpu` kernel option, and
    our paged decode kernel for decode): its warm-up prefill and sampler, then prefills, chunks and sampled decode
    steps launch no kernel variant the stand-ins do not, and the stand-ins launch all seven kernels."""
    from dataclasses import replace

    from minivllm import kernels
    from minivllm.kernels.startup import warmup
    from minivllm.kernels.triton.paged_decode import paged_decode

    options = kernels.KernelOptions(triton_on_cpu=True)
    gpu_path = replace(kernels.pick("cpu", options=options), paged_decode=paged_decode)  # as with a flash backend
    with kernels.override(gpu_path):
        llm = LLM(
            tiny_qwen3,
            device="cpu",
            dtype=dtype,
            kvcache_block_size=16,
            max_model_len=128,
            max_num_batched_tokens=48,
            max_num_seqs=8,
            num_kvcache_blocks=32,
            kernels=options,
        )
        runner = llm.model_runner
        hot = SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True)
        with launches_recorded() as engine:
            warmup.warmup_model(runner)
            runner.bind_kv_cache(runner.kv_cache)  # the warm-up runs before the cache exists: it leaves none
            llm.generate([[1, 2, 3], list(range(5, 70)), [9] * 20], hot, use_tqdm=False)  # one prompt in chunks
        stand_ins = triton_compile.stand_in_launches(
            runner.config, runner.dtype, runner.device, sample=True, decode_kernel=True
        )
        with launches_recorded() as ahead:
            for launch in stand_ins:
                launch()
    assert {name for name, _, _ in ahead} == {name for name, _, _ in engine} == KERNELS
    assert engine - ahead == set(), f"launched by the engine, not by the stand-ins: {engine - ahead}"
    llm.exit()


def test_the_kernel_options_and_the_rank_choose_the_stand_ins(tiny_qwen3):
    """Only the kernels the engine will launch: none of the norms' and SiLU-mul's when torch.compile or eager
    torch runs them, no prologue when it is not fused, no decode kernel when the backend decodes itself, and the
    sampler's only on the rank that samples."""
    from minivllm.config import Config

    cpu = torch.device("cpu")

    def names(config=None, **kwargs) -> list[str]:
        config = config or Config(tiny_qwen3, device="cpu")
        return [f.__name__ for f in triton_compile.stand_in_launches(config, torch.float32, cpu, **kwargs)]

    assert names(sample=True, decode_kernel=True) == ["norms", "silu_mul", "prologue", "decode", "sampler"]
    assert names(sample=False, decode_kernel=False) == ["norms", "silu_mul", "prologue"]
    off = Config(tiny_qwen3, device="cpu", kernels=dict(compile=False, fused_prologue=False))
    assert names(off, sample=True, decode_kernel=True) == ["decode", "sampler"]


FRESH_PROCESS = """
import json, sys
from helpers.compile_counter import CompileCounter
counter = CompileCounter()
from minivllm import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=1024, max_num_batched_tokens=256, num_kvcache_blocks=64, dtype="bfloat16")
init = [[name, thread] for name, thread in zip(counter.triton_kernels, counter.triton_threads)]
before = counter.triton
hot = SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True)
outs = llm.generate([[5, 6, 7] * 50, [8] * 700, [3]], hot, use_tqdm=False)
phases, tokens = list(llm.model_runner.startup_seconds), [len(o.token_ids) for o in outs]
print(json.dumps(dict(init=init, after=counter.triton - before, phases=phases, tokens=tokens)))
llm.exit()
"""


@pytest.mark.gpu
def test_gpu_every_kernel_of_the_start_compiles_on_the_threads(tmp_path):
    """A fresh process over an empty Triton cache: each Triton compile of the engine's start runs on a thread of
    triton_compile.py (the warm-up prefill and the graph capture then compile nothing on the runner's thread:
    the stand-ins made the variants they launch), every kernel of the engine is among them, and requests after
    the start compile nothing."""
    from helpers.tiny_model import make_tiny_checkpoint

    model = make_tiny_checkpoint(str(tmp_path / "model"), "qwen3", dtype=torch.bfloat16, hidden_size=128, head_dim=64)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    out = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, model], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    elsewhere = [(name, thread) for name, thread in r["init"] if not thread.startswith(triton_compile.THREAD_PREFIX)]
    assert elsewhere == [], f"compiled outside the start-up threads: {elsewhere}"
    assert {name for name, _ in r["init"]} == KERNELS, r["init"]
    assert r["after"] == 0 and "triton_compile" in r["phases"] and r["tokens"] == [8, 8, 8], r
