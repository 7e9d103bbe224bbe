"""The engine's Triton kernels, compiled side by side at a GPU engine's start.

A GPU engine runs ten compiled variants of seven Triton kernels: RMSNorm with and without the residual add,
SiLU-mul, the attention prologue, the paged decode kernel unsplit and split and its combine, the sampler's race
over fp32 and over the model's logits and its reduction. On a machine with no Triton cache each costs 0.1-1 s
to compile, plus a C compile of its launcher, and they came one after the other, as the warm-up prefill and the
graph capture first met them: ~5 s of a bare start's warm-up and ~4 s of its capture.

Triton's compiler works mostly outside the interpreter lock (its passes in C++, ptxas and the C compiler in
their own processes), so those compiles can run at once, on threads. Each thread here launches one group of
the engine's kernels once, on a few zero rows with the model's sizes, through the same wrappers the layers call:
the same dtypes, constants and alignments, so the same compiled variants. The runner starts them first thing
and waits for them before its warm-up prefill, which then finds every kernel compiled and loaded. Variants of
one kernel share a thread (Triton makes a kernel's per-device cache on first use, unlocked). With a warm
Triton cache the threads only load the kernels from disk. Bare init 13.0 -> 9.4 s (benchmarks/HISTORY.md), the
threads running beside the runner's import of FlashAttention-4 and its model load.

What is not covered compiles where it would otherwise (the warm-up or the capture): the kernels of the paths that
kernel options turn off by default (minivllm/kernels). tests/test_triton_compile.py checks on CPU that the stand-ins
launch every variant the engine launches, and on a GPU that no Triton kernel of the engine's start compiles
outside these threads."""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton

from minivllm.kernels.startup.attention_compile import StandIn
from minivllm.kernels.triton.activation import silu_and_mul_triton
from minivllm.kernels.triton.attention_prologue import attention_prologue
from minivllm.kernels.triton.layernorm import rms_norm_triton
from minivllm.kernels.triton.paged_decode import paged_decode
from minivllm.kernels.triton.sampler import inverse_cdf_sample
from minivllm.models.qwen3 import ARCHITECTURES, architecture_of

if TYPE_CHECKING:
    from minivllm.config import Config

THREAD_PREFIX = "minivllm-triton-compile"  # the compile counter and the GPU test tell these threads by name
ROWS = 16  # tokens or sequences of each stand-in launch: only the grid depends on it


def stand_in_launches(
    config: "Config", dtype: torch.dtype, device: torch.device, *, sample: bool, decode_kernel: bool
) -> list[Callable[[], None]]:
    """One function per thread; each launches a group of the engine's kernels once on zeros with this rank's
    sizes: those of the paths the kernel options leave on (minivllm/kernels); the paged decode kernel when the engine
    decodes with it (`decode_kernel`), the sampler's when this rank samples (`sample`, rank 0)."""
    hf, tp, options = config.hf_config, config.tensor_parallel_size, config.kernels
    h = StandIn.of(config)  # this rank's query and KV heads, head_dim and block size (attention_compile.py)
    hidden, intermediate, eps = hf.hidden_size, hf.intermediate_size // tp, hf.rms_norm_eps
    qk_norm = ARCHITECTURES[architecture_of(hf)][2]  # (q/k/v bias, o bias, QK-norm)
    zeros = lambda *shape, dtype=dtype: torch.zeros(*shape, dtype=dtype, device=device)
    i32 = torch.int32

    def norms() -> None:  # the layers' RMSNorm, then add + RMSNorm (kernels/triton/layernorm.py)
        x, w = zeros(ROWS, hidden), zeros(hidden)
        rms_norm_triton(x, w, eps)
        rms_norm_triton(x, w, eps, residual=x)

    def silu_mul() -> None:  # the MLP's activation (kernels/triton/activation.py)
        silu_and_mul_triton(zeros(ROWS, 2 * intermediate))

    def prologue() -> None:  # QK-norm, RoPE and the store into a one-block cache, every slot -1 (nothing written)
        cache = zeros(1, h.block_size, h.kv_heads, h.head_dim)  # (blocks, block_size, Hkv, D)
        norm_weight = zeros(h.head_dim) if qk_norm else None
        attention_prologue(
            zeros(ROWS, (h.heads + 2 * h.kv_heads) * h.head_dim),  # qkv (N, (H + 2 Hkv) * D)
            zeros(ROWS, dtype=i32),  # positions
            zeros(1, 1, h.head_dim, dtype=torch.float32),  # the rotary cache, [cos | sin] in fp32
            num_heads=h.heads,
            num_kv_heads=h.kv_heads,
            head_dim=h.head_dim,
            q_weight=norm_weight,
            k_weight=norm_weight,
            eps=eps,
            k_cache=cache,
            v_cache=cache,
            slot_mapping=torch.full((ROWS,), -1, dtype=i32, device=device),
            use_pdl=options.pdl,
        )

    def decode() -> None:  # the paged decode kernel, unsplit, then split with its combine (kernels/triton/)
        q, cache = zeros(ROWS, h.heads, h.head_dim), zeros(1, h.block_size, h.kv_heads, h.head_dim)
        lens, tables = torch.ones(ROWS, dtype=i32, device=device), zeros(ROWS, 1, dtype=i32)  # one key, in block 0
        for splits in (1, 2):
            paged_decode(q, cache, cache, lens, tables, h.head_dim**-0.5, splits=splits, use_pdl=options.pdl)

    def sampler() -> None:  # the draw over the filters' fp32 logits and over the LM head's own (kernels/triton/)
        temperatures, seed = torch.ones(ROWS, device=device), zeros(1, dtype=torch.int64)
        for logits_dtype in dict.fromkeys((torch.float32, dtype)):
            inverse_cdf_sample(zeros(ROWS, hf.vocab_size, dtype=logits_dtype), temperatures, seed)

    wanted = {
        norms: options.compile is None,  # else torch.compile or eager torch
        silu_mul: options.compile is None,
        prologue: options.fused_prologue,
        decode: decode_kernel,
        sampler: sample,
    }
    return [launch for launch, on in wanted.items() if on]


@dataclass
class TritonCompile:
    """The stand-in launches under way on their threads."""

    pool: ThreadPoolExecutor
    future: Future  # its result: the futures of the launches

    def wait(self) -> None:
        """Until every kernel is compiled and loaded; a stand-in's error raises here."""
        try:
            for f in self.future.result():
                f.result()
        finally:
            self.pool.shutdown(wait=False)


def start(config: "Config", device: torch.device, dtype: torch.dtype, rank: int) -> TritonCompile:
    """Launch the stand-ins on threads, each on its own stream of `device`. Triton's driver (a C module it builds
    on first use) is made once, on the first thread, before the others start. The paged decode kernel is left
    out only where the engine cannot decode with it: the torch backend asked for, or the flash backends' own
    decode (the `decode_kernel` kernel option); an engine whose torch backend is chosen because nothing else imports
    compiles it for nothing, on a thread."""
    decode_kernel = config.attention_backend != "torch" and config.kernels.decode_kernel == "triton"
    launches = stand_in_launches(config, dtype, device, sample=rank == 0, decode_kernel=decode_kernel)
    pool = ThreadPoolExecutor(max_workers=len(launches) + 1, thread_name_prefix=THREAD_PREFIX)

    @torch.inference_mode()
    def run(launch: Callable[[], None]) -> None:
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):  # makes the stream's device current on this thread too
            launch()
        stream.synchronize()

    def fan_out() -> list[Future]:
        with torch.cuda.device(device):
            triton.runtime.driver.active.get_current_device()
        return [pool.submit(run, launch) for launch in launches]

    return TritonCompile(pool, pool.submit(fan_out))
