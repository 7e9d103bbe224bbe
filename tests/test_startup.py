"""Start-up work that only a GPU engine does (minivllm/engine/model_runner.py), run on CPU where it can be:
the prefill over the cache warmed up at start-up must work for every engine shape, including a context no
longer than one block (no prefix can be cached then)."""

import warnings

import pytest
import torch

from minivllm import LLM, SamplingParams


@pytest.mark.parametrize(
    "block_size,max_model_len,expected",
    [
        (16, 256, [(16, 240)]),
        (256, 256, [(0, 256)]),
        (16, 20, [(16, 4)]),
        (16, 2048, [(16, 512)]),
    ],
)
def test_attention_warmup_fits_the_engine(tiny_qwen3, block_size, max_model_len, expected):
    llm = LLM(
        tiny_qwen3, device="cpu", kvcache_block_size=block_size, max_model_len=max_model_len, num_kvcache_blocks=8
    )
    runner, runs = llm.model_runner, []
    run_model = runner.run_model

    def recorded(inp, **kwargs):
        runs.append((int(inp.context_lens[0]) - len(inp.input_ids), len(inp.input_ids)))  # (cached, new) tokens
        logits = run_model(inp, **kwargs)
        assert logits.shape[0] == 1 and bool(logits.isfinite().all())
        return logits

    runner.run_model = recorded
    runner.compile_ahead.warmup_attention(runner)
    assert runs == expected
    runner.run_model = run_model  # the engine still answers afterwards
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].token_ids) == 2
    llm.exit()


def tokens_both_ways(make_llm, mid: int, long: int, max_tokens: int) -> dict[bool, list[list[int]]]:
    """Greedy tokens with every prefill's keys read through the page table (True: FlashAttention-4's way) and
    with the fresh-key path (False), on one engine each from `make_llm()`: prompts of 1 and 3 tokens, ids 3 to
    `mid`, the same plus two tokens (a prefix hit on the next call), and a `long`-token one (chunked by a small
    max_num_batched_tokens); then the prefix hit again."""
    prompts = [[1], [5, 6, 7], list(range(3, mid)), list(range(3, mid)) + [9, 9], [(7 * i) % 500 for i in range(long)]]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = {}
    for from_cache in (False, True):
        llm = make_llm()
        llm.model_runner.prefill_keys_from_cache = from_cache
        outputs[from_cache] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        outputs[from_cache] += [o.token_ids for o in llm.generate(prompts[3:4], greedy, use_tqdm=False)]  # a hit
        llm.exit()
    return outputs


def test_prefill_with_keys_from_the_cache_equals_the_fresh_path(tiny_qwen3):
    """What FlashAttention-4 engines do (every prefill reads its keys through the page table), run with the
    torch backend on CPU: the same tokens as the fresh-key path, for short and long prompts, a prefix hit and
    a prompt split into chunks."""
    kw = dict(device="cpu", kvcache_block_size=16, max_num_batched_tokens=64, num_kvcache_blocks=64)
    outputs = tokens_both_ways(lambda: LLM(tiny_qwen3, **kw), mid=60, long=150, max_tokens=6)
    assert outputs[True] == outputs[False]


# --- on a GPU: nothing compiles after the engine has started ------------------------------------------------


@pytest.fixture(scope="module")
def gpu_bf16_qwen3(tmp_path_factory) -> str:
    import torch

    from helpers.tiny_model import make_tiny_checkpoint

    # head_dim 64 and bf16: what FlashAttention-4 runs (the CPU fixtures use head_dim 16, fp32)
    path = str(tmp_path_factory.mktemp("gpu_bf16_qwen3"))
    return make_tiny_checkpoint(path, "qwen3", dtype=torch.bfloat16, hidden_size=128, head_dim=64)


@pytest.mark.gpu
def test_gpu_nothing_compiles_after_start(gpu_bf16_qwen3):
    """After LLM(...) returns, requests of any shape compile nothing: no FlashAttention-4 variant (one serves
    every prefill), no torch.compile graph (the small ops are Triton kernels), no Triton kernel (start-up ran
    each one). Prompts of 1 to 300 tokens, one and many at a time, a prefix hit, chunked prompts, greedy and
    sampled: what a user's first requests look like."""
    from helpers.compile_counter import CompileCounter

    counter = CompileCounter()
    llm = LLM(gpu_bf16_qwen3, max_model_len=1024, max_num_batched_tokens=256, num_kvcache_blocks=64, dtype="bfloat16")
    before = counter.snapshot()
    lengths = [1, 2, 15, 16, 17, 64, 65, 129, 300]
    prompts = [[(13 * i + 7 * n) % 500 for i in range(n)] for n in lengths]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    hot = SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True)
    for p in prompts:  # one at a time
        llm.generate([p], greedy, use_tqdm=False)
    llm.generate(prompts, hot, use_tqdm=False)  # together, and hits on every prefix above
    llm.generate([prompts[-1] + [3] * 40, [4] * 700], greedy, use_tqdm=False)  # a hit plus a new chunked prompt
    delta = CompileCounter.delta(before, counter.snapshot())
    assert delta == dict(triton=0, dynamo_graphs=0, fa4=0), (
        f"compiled after start-up: {delta}; Triton kernels {counter.triton_kernels[-delta['triton'] :]}"
    )
    llm.exit()


HELPER_PROCESS = """
import json, sys
from minivllm import LLM, SamplingParams
from flash_attn.cute import cache_utils
exports, export = [], cache_utils.JITPersistentCache._try_export_to_storage
def recorded(self, key, fn):  # FlashAttention-4 exports each kernel it compiles
    exports.append(key)
    return export(self, key, fn)
cache_utils.JITPersistentCache._try_export_to_storage = recorded
llm = LLM(sys.argv[1], max_model_len=1024, max_num_batched_tokens=256, num_kvcache_blocks=64, dtype="bfloat16")
phases = list(llm.model_runner.startup_seconds)
outs = llm.generate([[5, 6, 7] * 50, [8] * 700], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(json.dumps(dict(phases=phases, exports=len(exports), tokens=[o.token_ids for o in outs])))
llm.exit()
"""


@pytest.mark.gpu
def test_gpu_helper_process_compiles_the_kernel_prefills_run(gpu_bf16_qwen3, tmp_path):
    """On an empty FlashAttention-4 disk cache, the engine's runner starts the helper process first thing, sends it
    the stand-in and waits for it before sizing the KV cache; the kernel it put on disk is the one the
    engine's attention warm-up and its prefills (short, chunked) then run: this process compiles none."""
    import json
    import os
    import subprocess
    import sys

    from helpers.gpu import skip_without_fa4

    skip_without_fa4()
    cache = tmp_path / "fa4"
    env = dict(os.environ, FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=str(cache), FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="1")
    out = subprocess.run(
        [sys.executable, "-c", HELPER_PROCESS, gpu_bf16_qwen3], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert "attention_process" in r["phases"], r
    assert r["exports"] == 0, r  # nothing compiled here: the helper's kernel served every prefill
    assert len(list(cache.rglob("*.o"))) == 1
    assert [len(t) for t in r["tokens"]] == [4, 4]


@pytest.mark.gpu
def test_gpu_fa4_prefill_over_the_cache_equals_its_fresh_path(gpu_bf16_qwen3):
    """FlashAttention-4 engines read every prefill's keys through the page table: greedy tokens equal those of
    its fresh-key kernel (the path before), for short and long prompts, a prefix hit and chunks."""
    from helpers.gpu import skip_without_fa4

    skip_without_fa4()

    def make_llm():
        llm = LLM(gpu_bf16_qwen3, max_num_batched_tokens=256, num_kvcache_blocks=64, dtype="bfloat16")
        assert llm.model_runner.backend.name == "fa4" and llm.model_runner.prefill_keys_from_cache
        return llm

    outputs = tokens_both_ways(make_llm, mid=90, long=300, max_tokens=12)
    assert outputs[True] == outputs[False]


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a CPU engine through the Triton interpreter, which minivllm turns on only without CUDA (on a GPU the "
    "kernels refuse CPU tensors); there test_gpu_nothing_compiles_after_start covers the warm-up",
)
def test_warmup_prefill_stores_into_a_stand_in_cache(tiny_qwen3):
    """The GPU warm-up (kernels/startup/warmup.py), run on CPU through the Triton kernels: its prefill hands the
    layers a one-block stand-in cache with every slot -1 (so the kernels compile their storing variant) and, for
    the step, the torch attention when the backend reads keys from the cache; afterwards the layers hold no cache
    (the runner gives them the real one next) and keep their backend, the real cache is untouched, and the engine
    answers as before once it has its cache back."""
    from functools import partial

    from minivllm import kernels
    from minivllm.kernels.startup import warmup

    llm = LLM(
        tiny_qwen3,
        device="cpu",
        kvcache_block_size=16,
        max_model_len=64,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        num_kvcache_blocks=8,
    )
    runner = llm.model_runner
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5]], greedy, use_tqdm=False)]
    layers = runner.attn_layers
    backends, prologues = [m.backend for m in layers], [m.prologue for m in layers]
    runner.kv_cache.fill_(1.0)
    seen, gpu_path = [], kernels.pick("cpu", options=kernels.KernelOptions(triton_on_cpu=True))

    def recorded(layer, qkv, positions, cos_sin_cache, **kwargs):
        seen.append((tuple(kwargs["k_cache"].shape), kwargs["slot_mapping"].tolist(), layer.backend.name))
        return gpu_path.attention_prologue(qkv, positions, cos_sin_cache, **kwargs)

    runner.prefill_keys_from_cache = True  # as with FlashAttention-4
    for m in layers:  # the layers as the GPU path builds them: the fused prologue, recorded
        m.prologue = partial(recorded, m)
    try:
        warmup.warmup_model(runner)
    finally:
        runner.prefill_keys_from_cache = False
        for m, prologue in zip(layers, prologues):
            m.prologue = prologue
    assert len(seen) == len(layers)
    shape, slots, backend = seen[0]
    assert shape == (1, 16, *runner.kv_cache.shape[4:])  # one block
    assert set(slots) == {-1} and len(slots) == 64  # max_model_len tokens, none stored
    assert backend == "torch"
    assert all(m.backend is b for m, b in zip(layers, backends)) and all(m.k_cache.numel() == 0 for m in layers)
    assert bool((runner.kv_cache == 1.0).all())  # the real cache was not written
    runner.kv_cache.zero_()
    runner.bind_kv_cache(runner.kv_cache)
    llm.reset_prefix_cache()
    assert [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5]], greedy, use_tqdm=False)] == before
    llm.exit()


@pytest.mark.parametrize("block_size,max_model_len", [(16, 2048), (256, 4096), (16, 20)])
def test_attention_compile_ahead_makes_the_warmup_prefills_call(tiny_qwen3, monkeypatch, block_size, max_model_len):
    """FlashAttention-4's kernel compiles ahead during start-up (kernels/startup/attention_compile.py), over a
    stand-in cache; it must be the kernel warmup_attention's prefill then runs, so the stand-in must make the
    layers' call: the same dtypes, head counts, page size, tokens, batch and which arguments are given (what
    the kernel's compile key is made of). Both calls recorded with the torch backend on CPU."""
    from minivllm.kernels import attention_backends
    from minivllm.kernels.startup import attention_compile

    calls, prefill_paged = [], attention_backends.TorchBackend.prefill_paged

    def recorded(backend, q, k_cache, v_cache, **kw):
        calls.append(
            (
                q.dtype,
                tuple(q.shape),
                tuple(k_cache.shape[1:]),
                k_cache.dtype,
                v_cache.shape == k_cache.shape,
                tuple(
                    (name, None if t is None else (t.dtype, t.dim()))
                    for name, t in sorted(kw.items())
                    if name not in ("max_seqlen_q", "max_seqlen_k", "scale")
                ),
                len(kw["cu_seqlens_q"]) - 1,  # sequences
                max(kw["max_seqlen_q"], attention_backends.FA4_MIN_SEQLEN_Q),  # what FlashAttention-4 gets
                kw["scale"],
            )
        )
        return prefill_paged(backend, q, k_cache, v_cache, **kw)

    llm = LLM(
        tiny_qwen3, device="cpu", kvcache_block_size=block_size, max_model_len=max_model_len, num_kvcache_blocks=20
    )
    runner = llm.model_runner
    assert runner.compile_ahead.attention is None  # no thread on CPU
    runner.prefill_keys_from_cache = True  # as with FlashAttention-4
    monkeypatch.setattr(attention_backends.TorchBackend, "prefill_paged", recorded)
    runner.compile_ahead.warmup_attention(runner)
    layers = len(runner.attn_layers)
    assert len(calls) == layers and len(set(calls)) == 1
    stand_in = attention_compile.StandIn.of(runner.config)
    attention_compile.stand_in_prefill_attention(stand_in, runner.device, runner.dtype, backend="torch")
    assert len(calls) == layers + 1
    assert calls[-1] == calls[0]
    llm.exit()


@pytest.fixture
def fa4_cache(monkeypatch, tmp_path):
    """FlashAttention-4's disk-cache variables for one test (the module sets them with setdefault)."""
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "fa4"))
    return tmp_path / "fa4"


def test_attention_compile_helper_process_runs_the_stand_in_and_reports_failure(tiny_qwen3, fa4_cache):
    """The helper process (`python3 -m minivllm.kernels.startup.attention_compile`) imports, then gets the stand-in
    as a JSON line on its stdin and runs it: here with the torch backend on CPU, where it must exit cleanly; a
    backend it cannot run (FlashAttention-4 on CPU) makes wait() warn with the exit code and the helper's output
    (the runner then compiles in its own warm-up), and so does a helper that does not finish in time (then
    stopped): never a hang or an exception."""
    from minivllm.kernels.startup import attention_compile, attention_helper

    llm = LLM(tiny_qwen3, device="cpu", num_kvcache_blocks=8)
    config, cpu = llm.model_runner.config, torch.device("cpu")
    waiting = attention_helper.spawn_helper()
    ok = attention_compile.start(config, cpu, torch.float32, "process", backend="torch", helper=waiting)
    assert ok.where == "process" and ok.helper is waiting
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ok.wait()
    assert ok.helper is None and waiting.process.returncode == 0 and waiting.log.closed
    bad = attention_compile.start(config, cpu, torch.float32, "process")  # a fresh helper, backend="fa4"
    with pytest.warns(UserWarning, match="(?s)exited with 1.*Error"):
        bad.wait()
    slow = attention_compile.start(config, cpu, torch.float32, "process", backend="torch")
    process = slow.helper.process
    with pytest.warns(UserWarning, match="no exit after 0 s"):
        slow.wait(timeout=0.01)  # still importing
    assert process.poll() is not None  # stopped
    llm.exit()


def test_a_helper_without_a_request_exits_on_its_own(fa4_cache):
    """A helper whose engine sends nothing exits once its idle time is up, and one whose engine's process closed
    its stdin exits at once, both without compiling: neither is left behind."""
    from minivllm.kernels.startup import attention_helper

    idle = attention_helper.spawn_helper(idle_s=0.5)
    assert idle.process.wait(timeout=120) == attention_helper.NO_REQUEST
    idle.cancel()
    assert idle.log.closed
    closed = attention_helper.spawn_helper(idle_s=600)
    closed.process.stdin.close()
    assert closed.process.wait(timeout=120) == attention_helper.NO_REQUEST
    closed.cancel()


def test_an_engine_stops_the_helper_it_does_not_use(tiny_qwen3, fa4_cache, monkeypatch):
    """An engine that started a helper but compiles no FlashAttention-4 kernel (its backend is torch's here) stops
    it, and one whose start-up fails after sending it the stand-in stops it too; neither leaves it compiling
    beside the next engine's KV-cache sizing."""
    from minivllm.engine.model_runner import ModelRunner
    from minivllm.kernels import attention_backends
    from minivllm.kernels.startup import attention_compile

    spawned, spawn = [], attention_compile.spawn_helper
    monkeypatch.setattr(attention_compile, "spawn_helper", lambda **kw: spawned.append(spawn(**kw)) or spawned[-1])
    monkeypatch.setattr(attention_compile, "fa4_expected", lambda device, dtype, name: True)
    LLM(tiny_qwen3, device="cpu", num_kvcache_blocks=8).exit()  # "auto", an empty disk cache: a helper
    assert len(spawned) == 1 and spawned[0].process.poll() is not None and spawned[0].log.closed

    monkeypatch.setattr(attention_backends, "select", lambda device, dtype, name: "fa4")

    def fails(self):
        assert self.compile_ahead.attention.helper is spawned[-1]  # the stand-in went to the helper
        raise RuntimeError("the checkpoint is broken")

    monkeypatch.setattr(ModelRunner, "load_model", fails)
    with pytest.raises(RuntimeError, match="the checkpoint is broken"):
        LLM(tiny_qwen3, device="cpu", num_kvcache_blocks=8)
    sent = spawned[-1]
    assert len(spawned) == 2 and sent.process.poll() is not None and sent.process.stdin.closed and sent.log.closed


def test_where_the_attention_kernel_compiles(tiny_qwen3, fa4_cache, monkeypatch):
    """ "auto": rank 0 sends it to a helper process while FlashAttention-4's disk cache is on and holds no kernel,
    else to a thread (the tensor-parallel workers always); the option can force either or turn both off; nothing
    ahead where FlashAttention-4 will not be the backend."""
    from minivllm.kernels import KernelOptions
    from minivllm.kernels.startup import attention_compile

    def no_flash_attn(name):
        raise ModuleNotFoundError("No module named 'flash_attn'")  # what find_spec does without the package

    with monkeypatch.context() as m:
        m.setattr(attention_compile.importlib.util, "find_spec", no_flash_attn)
        assert attention_compile.fa4_installed() is False  # an answer, not an error
    tmp_path = fa4_cache
    llm = LLM(tiny_qwen3, device="cpu", num_kvcache_blocks=8)
    runner = llm.model_runner
    assert runner.compile_ahead.attention is None and runner.compile_ahead.where is None  # CPU
    config, gpu = runner.config, torch.device("cuda", 0)
    where = lambda mode="auto", rank=0: attention_compile.where_to_compile(config, gpu, torch.bfloat16, mode, rank)
    assert attention_compile.where_to_compile(config, runner.device, torch.bfloat16, "auto") is None
    monkeypatch.setattr(attention_compile, "fa4_expected", lambda device, dtype, name: True)
    assert where() == "process" and where(rank=1) == "thread"
    with monkeypatch.context() as m:
        m.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")  # a helper's kernel would be lost with it
        assert where() == "thread"
    (tmp_path / "fingerprint").mkdir(parents=True)
    (tmp_path / "fingerprint" / "0123.lock").touch()  # a lock alone is no kernel
    assert where() == "process"
    (tmp_path / "fingerprint" / "0123.o").write_bytes(b"kernel")
    assert where() == "thread"  # the disk cache holds a kernel: a thread loads it
    for mode in ("process", "thread"):
        assert where(mode) == mode
    assert where("off") is None
    with pytest.raises(ValueError, match="unknown attention_compile 'later'"):
        KernelOptions(attention_compile="later")
    llm.exit()


def test_compile_counter_records_each_triton_compile_and_its_specialisation(monkeypatch):
    """bench.py's record of init: the counter wraps Triton's compile entry point and keeps, per compile, the
    kernel's name, its seconds and the key Triton compiled it for (what tells two variants of one kernel apart)."""
    from types import SimpleNamespace

    from triton.runtime.jit import JITFunction

    from helpers.compile_counter import CompileCounter

    monkeypatch.setattr(JITFunction, "_do_compile", lambda self, key, *args: f"kernel for {key}")
    counter = CompileCounter()
    kernel = SimpleNamespace(__name__="toy_kernel")
    assert JITFunction._do_compile(kernel, "[('*bf16', 'D')]", None) == "kernel for [('*bf16', 'D')]"
    assert JITFunction._do_compile(kernel, "[('*fp32', 'D')]", None) == "kernel for [('*fp32', 'D')]"
    assert counter.triton == 2 and counter.triton_kernels == ["toy_kernel", "toy_kernel"]
    assert counter.triton_keys == ["[('*bf16', 'D')]", "[('*fp32', 'D')]"]
    assert len(counter.triton_seconds) == 2


def test_compile_ahead_wait_names_the_attention_compile_it_waited_for():
    """wait() reports the seconds of the attention compile by where it ran, then lets go of it (a second wait has
    nothing left to wait for)."""
    from minivllm.config import Config
    from minivllm.kernels.startup import CompileAhead

    class Compile:  # a compile that ran on a thread, already done
        where, waited = "thread", 0

        def wait(self):
            self.waited += 1

    compile_ = Compile()
    ahead = CompileAhead(Config.__new__(Config), torch.device("cpu"), torch.float32, "thread", attention=compile_)
    assert list(ahead.wait()) == ["attention_thread"] and compile_.waited == 1
    assert ahead.wait() == {} and compile_.waited == 1
