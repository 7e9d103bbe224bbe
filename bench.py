"""Throughput benchmarks, measured the way users meet the engine.

GPU (the default when CUDA is present): nano-vllm's workload (256 prompts of random token ids, lengths uniform
in [100, 1024], max_tokens uniform in [100, 1024], temperature 0.6, ignore_eos) on a random-weight model with
Qwen3-0.6B's exact config, made here when --model is not given (no hub). And nano-vllm's procedure, in a fresh
process: start the engine (timed: init), generate one short prompt ("Benchmark: "), then time the workload
(the first run), then time it again (the warm runs; the prefix cache is reset in between, so no run reuses
another's prompts). That process runs twice: first with empty compile caches (a bare machine: Triton,
inductor and FlashAttention-4 caches in a fresh directory), then again with the caches the first one left on
disk. Prints a table and writes JSON with, per run, the step timeline and the compilations that happened in it.

CPU (--cpu): the embedded SmolLM2-135M-Instruct, 16 chat prompts x 64 greedy tokens, the engine against
transformers' generate on the same prompts, in float32 and bfloat16.

  python3 bench.py                  # GPU: bare and cached processes, first run vs warm
  python3 bench.py --cpu            # CPU: the engine vs transformers on SmolLM2

--structured json adds, in each process (GPU) or dtype (CPU), one more timed run of the same prompts with a JSON
schema on every request (minivllm/structured_outputs), reported beside the unconstrained throughput.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

T_START = time.perf_counter()

import torch  # noqa: E402

from minivllm.engine.triton_compile import THREAD_PREFIX  # noqa: E402
from minivllm.testing.benchmark import phase_times, roofline, save_json, workload  # noqa: E402
from minivllm.testing.compile_counter import CompileCounter  # noqa: E402
from minivllm.testing.tiny_model import QWEN3_0_6B, make_tiny_checkpoint  # noqa: E402

CACHE_ENV = {  # where each compiler keeps its on-disk cache
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "flash_attention_cute",
    "CUDA_CACHE_PATH": "cuda_driver",  # the driver's cache of PTX it compiled for this GPU, whoever loaded the PTX
}
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Give me a synonym for happy.",
    "Why is the sky blue?",
    "What does a bee make?",
    "Translate 'good morning' into Spanish.",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Name a planet in our solar system.",
    "What is the opposite of cold?",
    "Who wrote Romeo and Juliet?",
    "What color is a banana?",
    "Suggest a name for a cat.",
    "What is the largest ocean?",
]


# --- structured outputs: the same prompts with a JSON schema on every request ---------------------------------

STRUCTURED_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def structured_run(llm, prompts, params) -> dict:
    """One timed run of `prompts` with `params`, each constrained to STRUCTURED_SCHEMA. A request ends when its
    grammar does (then its output parses) or at max_tokens (cut inside the object)."""
    from dataclasses import replace

    from minivllm.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    params = [
        replace(p, structured_outputs=so) for p in (params if isinstance(params, list) else [params] * len(prompts))
    ]
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    done = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    valid = sum(isinstance(json.loads(c.text).get("answer"), str) for c in done)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return dict(kind="json", seconds=seconds, tokens=tokens, tok_per_s=tokens / seconds, stopped=len(done), valid=valid)


# --- GPU: one process of nano-vllm's procedure --------------------------------------------------------------


def one_process(args) -> dict:
    """nano-vllm's procedure in this process: init, one short prompt, then `runs` timed runs of the workload."""
    from minivllm import LLM, SamplingParams
    from minivllm.layers import attention_backend

    counter = CompileCounter()
    import_s = time.perf_counter() - T_START
    t = time.perf_counter()
    llm = LLM(args.model, tensor_parallel_size=args.tp, enforce_eager=args.enforce_eager, max_model_len=4096)
    init_s = time.perf_counter() - t
    init_compiles = [  # [kernel, seconds, the thread it compiled on]
        [name, round(s, 3), thread]
        for name, s, thread in zip(counter.triton_kernels, counter.triton_seconds, counter.triton_threads)
    ]
    init_keys = [[name, key] for name, key in zip(counter.triton_kernels, counter.triton_keys)]
    t = time.perf_counter()
    llm.generate(["Benchmark: "], SamplingParams(temperature=1.0, max_tokens=64), use_tqdm=False)
    short_s = time.perf_counter() - t
    prompts, params = workload(0, args.num_seqs, 100, args.max_input_len, args.max_output_len)
    runs = []
    for r in range(args.runs):
        if r:
            assert llm.reset_prefix_cache()  # the same prompts again, none of them cached
        torch.cuda.synchronize()
        before, start = counter.snapshot(), len(llm.step_log)
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        after = counter.snapshot()
        tokens = sum(len(o.token_ids) for o in outputs)
        assert tokens == sum(p.max_tokens for p in params), "every request must produce exactly max_tokens tokens"
        steps = [
            [int(s.is_prefill), s.num_seqs, round((s.schedule + s.run + s.postprocess) * 1e3, 3)]
            for s in llm.step_log[start:]
        ]
        runs.append(
            dict(
                seconds=seconds,
                tok_per_s=tokens / seconds,
                tokens=tokens,
                phases=phase_times(llm, start),
                compiled=CompileCounter.delta(before, after),
                steps=steps,
            )
        )
    structured = structured_run(llm, prompts, params) if args.structured else None
    floor = roofline(llm.config.hf_config, [len(p) for p in prompts], [p.max_tokens for p in params])
    result = dict(
        import_s=import_s,
        init_s=init_s,
        short_prompt_s=short_s,
        startup_phases=llm.model_runner.startup_seconds,
        init_triton_compiles=init_compiles,  # [kernel, seconds, thread] of each Triton compile (or cache load) in init
        init_triton_keys=init_keys,  # [kernel, what Triton specialised that compile on]
        runs=runs,
        structured=structured,
        floor=floor,
        backend=llm.model_runner.backend,
        decode_kernel=attention_backend.decode_kernel(llm.model_runner.backend),
        kv_cache_blocks=llm.config.num_kvcache_blocks,
        device=torch.cuda.get_device_name(),
    )
    llm.exit()
    return result


def run_gpu(args) -> dict:
    """Two fresh processes of `one_process`: bare (empty compile caches), then cached (what the first left)."""
    cache_root = args.compile_cache or tempfile.mkdtemp(prefix="minivllm-bench-caches-")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.update({name: os.path.join(cache_root, sub) for name, sub in CACHE_ENV.items()})
    child = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--model",
        args.model,
        "--runs",
        str(args.runs),
        "--num-seqs",
        str(args.num_seqs),
        "--max-input-len",
        str(args.max_input_len),
        "--max-output-len",
        str(args.max_output_len),
        "--tp",
        str(args.tp),
    ]
    child += ["--enforce-eager"] if args.enforce_eager else []
    child += ["--structured", args.structured] if args.structured else []
    result = dict(compile_cache_dir=cache_root, processes={})
    for name in ("bare", "cached"):
        if name == "bare" and any(
            os.listdir(os.path.join(cache_root, d))
            for d in CACHE_ENV.values()
            if os.path.isdir(os.path.join(cache_root, d))
        ):
            raise SystemExit(f"--compile-cache {cache_root} is not empty: a bare run needs empty caches")
        t = time.perf_counter()
        out = subprocess.run(child, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"the {name} process failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        process = json.loads(out.stdout.strip().splitlines()[-1])
        process["wall_s"] = time.perf_counter() - t
        result["processes"][name] = process
    return result


def structured_rows(name: str, s: dict | None, free_tok_per_s: float) -> list[tuple[str, str]]:
    if s is None:
        return []
    value = f"{s['tok_per_s']:.0f} ({s['tok_per_s'] / free_tok_per_s:.2f}x unconstrained; "
    return [(f"{name}: JSON schema tok/s", value + f"{s['stopped']} ended, {s['valid']} valid, {s['tokens']} tokens)")]


def summarize_gpu(result: dict) -> list[tuple[str, str]]:
    rows = []
    for name, p in result["processes"].items():
        first, warm = p["runs"][0], p["runs"][1:]
        warm_tps = sorted(r["tok_per_s"] for r in warm)[len(warm) // 2] if warm else float("nan")
        p["first_over_warm"] = first["tok_per_s"] / warm_tps
        p["warm_tok_per_s"] = warm_tps
        phases = " ".join(f"{k} {v:.1f}" for k, v in p["startup_phases"].items())
        rows += [
            (f"{name}: import + engine init s", f"{p['import_s']:.1f} + {p['init_s']:.1f}  ({phases})"),
            (
                f"{name}: first run s, tok/s",
                f"{first['seconds']:.2f}, {first['tok_per_s']:.0f}  (compiled: {first['compiled']})",
            ),
            (
                f"{name}: warm tok/s (median of {len(warm)})",
                f"{warm_tps:.0f}  (runs: " + ", ".join(f"{r['tok_per_s']:.0f}" for r in warm) + ")",
            ),
            (f"{name}: first / warm", f"{p['first_over_warm']:.2f}"),
            *structured_rows(name, p.get("structured"), warm_tps),
            (
                f"{name}: Triton kernels in init",
                f"{len(p['init_triton_compiles'])}, {sum(c[1] for c in p['init_triton_compiles']):.1f} s"
                f" ({sum(not c[2].startswith(THREAD_PREFIX) for c in p['init_triton_compiles'])} on the main thread)",
            ),
        ]
    p = result["processes"]["cached"]
    f = p["floor"]
    rows += [
        (
            "roofline floor s (kv/weights/prefill)",
            f"{f['floor_s']:.2f} ({f['kv_read_s']:.2f}/{f['weights_s']:.2f}/{f['prefill_s']:.2f})",
        ),
        ("floor tok/s", f"{p['runs'][0]['tokens'] / f['floor_s']:.0f}"),
        ("backend", p["backend"]),
    ]
    return rows


# --- CPU: the engine against transformers on the embedded model --------------------------------------------


def run_cpu(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minivllm import LLM, SamplingParams
    from minivllm.utils.default_model import default_model_dir

    model = args.model or default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[: args.num_seqs]]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    prompts = [tokenizer.encode(t) for t in texts]  # as the engine (and the CLI) tokenizes a text prompt
    n = args.max_output_len
    rows = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model, dtype=dtype)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        t = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        engine_s = time.perf_counter() - t
        greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        structured = structured_run(llm, prompts, greedy) if args.structured else None
        llm.exit()
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        width = max(len(p) for p in prompts)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        hf.generate(input_ids=ids[:1], attention_mask=mask[:1], do_sample=False, max_new_tokens=4, pad_token_id=pad)
        t = time.perf_counter()
        with torch.inference_mode():
            ref = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad,
            )
        hf_s = time.perf_counter() - t
        del hf
        eos = set(llm.eos)
        # the engine's ignore_eos may pick EOS and go on; transformers' min_new_tokens masks it: compare up to it
        same = 0
        for o, r in zip(outputs, ref[:, width:].tolist()):
            cut = next((i for i, t in enumerate(o.token_ids) if t in eos), n)
            same += o.token_ids[:cut] == r[:cut]
        tokens = len(prompts) * n
        rows[dtype] = dict(
            tokens=tokens,
            seconds=engine_s,
            tok_per_s=tokens / engine_s,
            hf_seconds=hf_s,
            hf_tok_per_s=tokens / hf_s,
            speedup=hf_s / engine_s,
            greedy_identical=f"{same}/{len(prompts)}",
            structured=structured,
        )
    return dict(
        model=os.path.basename(model),
        num_seqs=len(prompts),
        max_tokens=n,
        dtypes=rows,
        device="cpu",
        threads=torch.get_num_threads(),
    )


# --- main ----------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        help="HF checkpoint dir (GPU default: a random Qwen3-0.6B-shaped model made here; "
        "CPU default: the embedded SmolLM2-135M-Instruct)",
    )
    ap.add_argument("--cpu", action="store_true", help="the CPU comparison with transformers")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per process: the first, then warm ones")
    ap.add_argument("--num-seqs", type=int, default=None)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    ap.add_argument("--structured", choices=["json"], help="also a run with a JSON schema on every request")
    ap.add_argument("--compile-cache", default=None, help="GPU: directory for the compile caches (must be empty)")
    ap.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "minivllm"))
    ap.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/first_run_gpu.json, or throughput_cpu.json)"
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one process of the GPU procedure
    args = ap.parse_args()
    cpu = args.cpu or not torch.cuda.is_available()
    args.num_seqs = args.num_seqs or (16 if cpu else 256)
    args.max_output_len = args.max_output_len or (64 if cpu else 1024)
    if args.child:
        print(json.dumps(one_process(args)))
        return
    if cpu:
        result = run_cpu(args)
        rows = []
        for dtype, r in result["dtypes"].items():
            rows += [
                (f"{dtype}: minivllm s, tok/s", f"{r['seconds']:.2f}, {r['tok_per_s']:.1f}"),
                (f"{dtype}: transformers s, tok/s", f"{r['hf_seconds']:.2f}, {r['hf_tok_per_s']:.1f}"),
                (f"{dtype}: speed-up", f"{r['speedup']:.2f}x"),
                (f"{dtype}: greedy tokens identical", r["greedy_identical"]),
                *structured_rows(dtype, r["structured"], r["tok_per_s"]),
            ]
        title = f"{result['num_seqs']} chat prompts x {result['max_tokens']} tokens, {result['model']}, CPU"
    else:
        args.model = args.model or make_tiny_checkpoint(
            os.path.join(args.cache, "qwen3-0.6b-random"), "qwen3", dtype=torch.bfloat16, **QWEN3_0_6B
        )
        result = run_gpu(args)
        rows = summarize_gpu(result)
        title = f"nano-vllm's procedure on {result['processes']['cached']['device']}"
    width = max(len(k) for k, _ in rows)
    print(f"minivllm bench: {title}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    name = "throughput_cpu.json" if cpu else "first_run_gpu.json"  # GPU: first run and warm runs, bare and cached
    save_json(result, args.out or os.path.join("benchmarks", "results", name))


if __name__ == "__main__":
    main()
