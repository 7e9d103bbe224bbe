"""FlashAttention-4's one prefill kernel, compiled ahead of the engine's first prefill (GPU start-up only).

FlashAttention-4 compiles a kernel the first time it meets a variant (~4-6 s on a bare machine); every prefill
of ours runs one variant (model_runner.py, `prefill_keys_from_cache`). Its compile key holds the dtypes, head
counts, page size and which arguments are given, not the sizes, so a prefill over a stand-in cache of a few
blocks compiles the kernel every prefill runs (tests/test_startup.py compares the two calls). That stand-in
prefill runs while the runner loads the model and compiles its Triton kernels:

- in a helper process (attention_helper.py), when FlashAttention-4's on-disk cache holds no kernel yet (a bare
  machine). A helper pays its own imports of torch and FlashAttention-4 (5-9 s), so rank 0's
  runner starts it first thing, where those imports overlap the engine's own set-up (the GPU's context,
  FlashAttention-4's import, the model's load). The runner waits for it before sizing the KV cache (its GPU
  memory must be gone by then), then loads the kernel from the disk cache;
- on a thread, when the disk cache holds kernels (the compile is then a load of ~0.3 s), is off, or on the
  tensor-parallel workers: the thread shares the interpreter lock, which on a bare machine cost the runner
  3.5-6 s of its load.

The `attention_compile` kernel option forces either, or "off" (`warmup_attention` then compiles on the main
thread)."""

import importlib.util
import json
import os
import select
import subprocess
import sys
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from minivllm.kernels import attention_backends
from minivllm.kernels.startup.attention_helper import HELPER_WAIT_S, NO_REQUEST, Helper, spawn_helper

if TYPE_CHECKING:
    from minivllm.config import Config


def attention_warmup_tokens(config: "Config") -> tuple[int, int, int]:
    """(cached, new, blocks) of the attention warm-up's one prefill: one block of tokens from the cache (when a
    prefix can be cached at all), up to 512 new tokens, and the blocks the two fill."""
    block_size = config.kvcache_block_size
    cached = block_size if config.max_model_len > block_size else 0  # a cached prefix needs room after it
    new = min(512, config.max_num_batched_tokens, config.max_model_len - cached)
    return cached, new, -(-(cached + new) // block_size)


@dataclass(frozen=True)
class StandIn:
    """The attention warm-up's prefill as FlashAttention-4's compile key sees it: plain numbers, so a helper
    process gets it as JSON without importing the engine's config (transformers)."""

    heads: int  # this rank's query heads
    kv_heads: int
    head_dim: int
    block_size: int
    cached: int  # tokens read from the cache
    new: int  # new tokens (queries)
    blocks: int

    @classmethod
    def of(cls, config: "Config") -> "StandIn":
        hf, tp = config.hf_config, config.tensor_parallel_size
        cached, new, blocks = attention_warmup_tokens(config)
        return cls(
            heads=hf.num_attention_heads // tp,
            kv_heads=max(1, hf.num_key_value_heads // tp),
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            block_size=config.kvcache_block_size,
            cached=cached,
            new=new,
            blocks=blocks,
        )


@torch.inference_mode()
def stand_in_prefill_attention(s: StandIn, device: torch.device, dtype: torch.dtype, backend: str = "fa4") -> None:
    """The attention of warmup_attention's prefill alone, on zeros in a stand-in cache (on a side stream on a
    GPU): the same call as the layer's, so the same kernel."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(stream):  # makes the stream's device current too; no-op for None (CPU)
        q = torch.zeros(s.new, s.heads, s.head_dim, dtype=dtype, device=device)  # (new, H, D)
        k_cache = torch.zeros(s.blocks, s.block_size, s.kv_heads, s.head_dim, dtype=dtype, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        attention_backends.create(backend).prefill_paged(
            q,
            k_cache,
            torch.zeros_like(k_cache),
            cu_seqlens_q=torch.tensor([0, s.new], **i32),
            cu_seqlens_k=torch.tensor([0, s.cached + s.new], **i32),
            max_seqlen_q=s.new,
            max_seqlen_k=s.cached + s.new,
            context_lens=torch.tensor([s.cached + s.new], **i32),
            block_tables=torch.arange(s.blocks, **i32).view(1, s.blocks),  # (1, blocks)
            scale=s.head_dim**-0.5,
        )
    if stream is not None:
        stream.synchronize()


def disk_cache_holds_kernels(cache_dir: str) -> bool:
    """Whether FlashAttention-4's on-disk cache (`disk_cache_dir`) holds any compiled kernel. Any: which file is
    ours is a hash of its compile key, known only inside its interface. A cache of another model's (or another
    release's) kernels only sends the compile to a thread."""
    return any(Path(cache_dir).rglob("*.o"))


@dataclass
class AttentionCompile:
    """A compile under way, on a thread (`future`) or in a helper process (`helper`)."""

    where: str  # "thread" or "process"
    future: Future | None = None
    helper: Helper | None = None

    def wait(self, timeout: float = HELPER_WAIT_S) -> None:
        """Until the kernel is compiled (and on disk, from a helper). A thread's error raises here; a helper that
        failed, or did not finish within `timeout` seconds (then stopped), is a warning: the runner's own
        attention warm-up then compiles the kernel."""
        if self.future is not None:
            self.future.result()
        if self.helper is None:
            return
        helper, self.helper = self.helper, None
        try:
            code = helper.process.wait(timeout)
            failure = f"exited with {code}" if code != 0 else None
        except subprocess.TimeoutExpired:
            failure = f"no exit after {timeout:.0f} s (stopped)"
        if failure is not None:
            helper.log.seek(0)
            tail = helper.log.read().decode(errors="replace")[-2000:]
            warnings.warn(
                f"the FlashAttention-4 compile process: {failure}; compiling in this process.\n{tail}", stacklevel=2
            )
        helper.cancel()

    def cancel(self) -> None:
        """Stop a helper whose kernel is no longer wanted (the engine chose another backend, or failed to start)."""
        if self.helper is not None:
            self.helper.cancel()
            self.helper = None


def fa4_installed() -> bool:
    """Whether `flash_attn.cute` can be found, without importing it (find_spec imports only its parent, and
    raises when there is none)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:
        return False


def fa4_expected(device: torch.device, dtype: torch.dtype, name: str | None) -> bool:
    """Whether `attention_backends.select` will choose FlashAttention-4, known without importing it (seconds)."""
    return (
        device.type == "cuda"
        and name in (None, "fa4")
        and dtype in (torch.float16, torch.bfloat16)
        and torch.cuda.get_device_capability(device)[0] >= 9
        and fa4_installed()
    )


def disk_cache_dir() -> str | None:
    """FlashAttention-4's disk cache directory, or None when its disk cache is off (a helper's kernel would
    then be lost with the helper)."""
    attention_backends.fa4_cache_env()  # on unless the user turned it off
    if os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") != "1":
        return None
    return os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")


def where_to_compile(
    config: "Config", device: torch.device, dtype: torch.dtype, mode: str, rank: int = 0
) -> str | None:
    """ "process", "thread" or None (warmup_attention compiles), from the option's `mode`: "auto" sends rank 0's
    compile to a helper process when FlashAttention-4's disk cache is on and holds no kernel yet (the helper
    exports there), else to a thread; nothing ahead unless FlashAttention-4 will be the backend."""
    if mode == "off" or not fa4_expected(device, dtype, config.attention_backend):
        return None
    if mode != "auto":
        return mode
    cache_dir = disk_cache_dir()
    empty = cache_dir is not None and not disk_cache_holds_kernels(cache_dir)
    return "process" if rank == 0 and empty else "thread"


def start(
    config: "Config",
    device: torch.device,
    dtype: torch.dtype,
    where: str,
    backend: str = "fa4",
    helper: Helper | None = None,
) -> AttentionCompile:
    """Start compiling `backend`'s kernel on a thread (after `attention_backends.select` has imported
    FlashAttention-4) or in `helper` (a fresh one if None)."""
    s = StandIn.of(config)
    if where == "thread":
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-attention-compile")
        future = pool.submit(stand_in_prefill_attention, s, device, dtype, backend)
        pool.shutdown(wait=False)  # its one thread ends with the job
        return AttentionCompile("thread", future=future)
    helper = helper or spawn_helper(cache_dir=disk_cache_dir())
    request = dict(stand_in=asdict(s), device=str(device), dtype=str(dtype).removeprefix("torch."), backend=backend)
    try:
        helper.process.stdin.write((json.dumps(request) + "\n").encode())
        helper.process.stdin.close()  # one request; it exits once the kernel is on disk
    except BrokenPipeError:  # it exited meanwhile: wait() reports how
        pass
    return AttentionCompile("process", helper=helper)


def main(argv: list[str]) -> int:
    """The helper process: import torch and FlashAttention-4, wait on stdin for one stand-in (JSON), run it
    (FlashAttention-4 exports the compiled kernel to its disk cache), exit 0. No request within `argv[0]`
    seconds, or stdin closed (the engine's process ended): exit NO_REQUEST without compiling."""
    attention_backends.available("cuda")  # imports FlashAttention-4 (seconds) before the request comes
    ready, _, _ = select.select([sys.stdin], [], [], float(argv[0]))
    line = sys.stdin.readline() if ready else ""
    if not line.strip():
        return NO_REQUEST
    request = json.loads(line)
    device = torch.device(request["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, request["dtype"])
    stand_in_prefill_attention(StandIn(**request["stand_in"]), device, dtype, request["backend"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
