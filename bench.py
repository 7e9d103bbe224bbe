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
  python3 bench.py --tp 2           # the same on two GPUs
  python3 bench.py --cpu            # CPU: the engine vs transformers on SmolLM2

--structured json adds, in each process (GPU) or dtype (CPU), one more timed run of the same prompts with a JSON
schema on every request (minivllm/frontend/structured_outputs), reported beside the unconstrained throughput.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()

sys.path.insert(0, str(Path(__file__).resolve().parents[0] / "tests"))  # tests/helpers
import torch  # noqa: E402

from helpers import benchmark as bm  # noqa: E402
from helpers.compile_counter import CompileCounter  # noqa: E402
from helpers.tiny_model import QWEN3_0_6B, make_tiny_checkpoint  # noqa: E402

CACHE_ENV = {  # where each compiler keeps its on-disk cache
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "flash_attention_cute",
    "CUDA_CACHE_PATH": "cuda_driver",  # the driver's cache of PTX it compiled for this GPU, whoever loaded the PTX
}


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


def structured_rows(name: str, s: dict | None, free_tok_per_s: float) -> list[tuple[str, str]]:
    if s is None:
        return []
    value = f"{s['tok_per_s']:.0f} ({s['tok_per_s'] / free_tok_per_s:.2f}x unconstrained; "
    return [(f"{name}: JSON schema tok/s", value + f"{s['stopped']} ended, {s['valid']} valid, {s['tokens']} tokens)")]


# --- GPU: one process of nano-vllm's procedure --------------------------------------------------------------


def timed_run(llm, counter: CompileCounter, prompts: list[list[int]], params: list) -> dict:
    """One timed run of the workload: seconds, tokens, the phases of its steps, what compiled inside it, and its
    step timeline ([is_prefill, running sequences, ms] per step)."""
    torch.cuda.synchronize()
    before, start = counter.snapshot(), llm.step_log.mark()
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outputs)
    assert tokens == sum(p.max_tokens for p in params), "every request must produce exactly max_tokens tokens"
    steps = [
        [int(s.is_prefill), s.num_seqs, round((s.schedule + s.run + s.postprocess) * 1e3, 3)]
        for s in llm.step_log.since(start)
    ]
    compiled = CompileCounter.delta(before, counter.snapshot())
    return dict(
        seconds=seconds,
        tok_per_s=tokens / seconds,
        tokens=tokens,
        phases=bm.phase_times(llm.step_log.since(start)),
        compiled=compiled,
        steps=steps,
    )


def one_process(args) -> dict:
    """nano-vllm's procedure in this process: init, one short prompt, then `runs` timed runs of the workload."""
    from minivllm import LLM, SamplingParams

    counter = CompileCounter()  # before the engine: it counts init's compiles too
    import_s = time.perf_counter() - T_START
    t = time.perf_counter()
    llm = LLM(args.model, tensor_parallel_size=args.tp, enforce_eager=args.enforce_eager, max_model_len=4096)
    init_s = time.perf_counter() - t
    facts = bm.engine_facts(llm, counter)
    t = time.perf_counter()
    llm.generate(["Benchmark: "], SamplingParams(temperature=1.0, max_tokens=64), use_tqdm=False)
    short_s = time.perf_counter() - t
    prompts, params = bm.workload(0, args.num_seqs, 100, args.max_input_len, args.max_output_len)
    runs = []
    for r in range(args.runs):
        if r:
            assert llm.reset_prefix_cache()  # the same prompts again, none of them cached
        runs.append(timed_run(llm, counter, prompts, params))
    structured = structured_run(llm, prompts, params) if args.structured else None
    floor = bm.roofline(llm.config.hf_config, [len(p) for p in prompts], [p.max_tokens for p in params])
    llm.exit()
    return dict(
        import_s=import_s, init_s=init_s, short_prompt_s=short_s, **facts, runs=runs, structured=structured, floor=floor
    )


def child_command(model: str) -> list[str]:
    """One fresh process of the GPU procedure: this script with this run's own arguments (so an option added to
    parse_args reaches the child too), the model made here, and --child."""
    return [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", "--model", model]


def run_gpu(args) -> dict:
    """Two fresh processes of `one_process`: bare (empty compile caches), then cached (what the first left)."""
    cache_root = args.compile_cache or tempfile.mkdtemp(prefix="minivllm-bench-caches-")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.update({name: os.path.join(cache_root, sub) for name, sub in CACHE_ENV.items()})
    child = child_command(args.model)
    result = dict(compile_cache_dir=cache_root, processes={})
    for name in ("bare", "cached"):
        dirs = [os.path.join(cache_root, d) for d in CACHE_ENV.values()]
        if name == "bare" and any(os.path.isdir(d) and os.listdir(d) for d in dirs):
            raise SystemExit(f"--compile-cache {cache_root} is not empty: a bare run needs empty caches")
        t = time.perf_counter()
        out = subprocess.run(child, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"the {name} process failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        process = json.loads(out.stdout.strip().splitlines()[-1])
        process["wall_s"] = time.perf_counter() - t
        result["processes"][name] = process
    return result


def summarize_gpu(result: dict) -> tuple[str, list[tuple[str, str]]]:
    rows = []
    for name, p in result["processes"].items():
        first, warm = p["runs"][0], p["runs"][1:]
        warm_tps = sorted(r["tok_per_s"] for r in warm)[len(warm) // 2] if warm else float("nan")
        p["first_over_warm"] = first["tok_per_s"] / warm_tps
        p["warm_tok_per_s"] = warm_tps
        phases = " ".join(f"{k} {v:.1f}" for k, v in p["startup_phases"].items())
        compiles = p["init_triton_compiles"]
        rows += [
            (f"{name}: import + engine init s", f"{p['import_s']:.1f} + {p['init_s']:.1f}  ({phases})"),
            (f"{name}: first run s, tok/s", f"{first['seconds']:.2f}, {first['tok_per_s']:.0f}  ({first['compiled']})"),
            (
                f"{name}: warm tok/s (median of {len(warm)})",
                f"{warm_tps:.0f}  (runs: " + ", ".join(f"{r['tok_per_s']:.0f}" for r in warm) + ")",
            ),
            (f"{name}: first / warm", f"{p['first_over_warm']:.2f}"),
            *structured_rows(name, p.get("structured"), warm_tps),
            (
                f"{name}: Triton kernels in init",
                f"{len(compiles)}, {sum(c[1] for c in compiles):.1f} s ({p['init_main_thread_compiles']} on the "
                "main thread)",
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
    return f"nano-vllm's procedure on {p['device']}", rows


# --- CPU: the engine against transformers on the embedded model --------------------------------------------


def run_cpu(args) -> dict:
    """The engine against transformers' generate on the same chat prompts, in float32 and bfloat16."""
    from transformers import AutoTokenizer

    from minivllm import LLM, SamplingParams
    from minivllm.frontend.default_model import default_model_dir

    model = args.model or default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    chats = [[{"role": "user", "content": q}] for q in bm.CHAT_QUESTIONS[: args.num_seqs]]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    prompts = [tokenizer.encode(t) for t in texts]  # as the engine (and the CLI) tokenizes a text prompt
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    n, tokens, rows = args.max_output_len, len(prompts) * args.max_output_len, {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model, dtype=dtype)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        t = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        engine_s = time.perf_counter() - t
        greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        structured = structured_run(llm, prompts, greedy) if args.structured else None
        llm.exit()
        hf_s, reference = bm.transformers_greedy(model, prompts, n, dtype, pad)
        same = bm.greedy_agreement([o.token_ids for o in outputs], reference, set(llm.eos))
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


def summarize_cpu(result: dict) -> tuple[str, list[tuple[str, str]]]:
    rows = []
    for dtype, r in result["dtypes"].items():
        rows += [
            (f"{dtype}: minivllm s, tok/s", f"{r['seconds']:.2f}, {r['tok_per_s']:.1f}"),
            (f"{dtype}: transformers s, tok/s", f"{r['hf_seconds']:.2f}, {r['hf_tok_per_s']:.1f}"),
            (f"{dtype}: speed-up", f"{r['speedup']:.2f}x"),
            (f"{dtype}: greedy tokens identical", r["greedy_identical"]),
            *structured_rows(dtype, r["structured"], r["tok_per_s"]),
        ]
    return f"{result['num_seqs']} chat prompts x {result['max_tokens']} tokens, {result['model']}, CPU", rows


# --- main ----------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
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
    args.cpu = args.cpu or not torch.cuda.is_available()
    args.num_seqs = args.num_seqs or (16 if args.cpu else 256)
    args.max_output_len = args.max_output_len or (64 if args.cpu else 1024)
    return args


def main() -> None:
    args = parse_args()
    if args.child:  # the GPU procedure's fresh process: its result is the last line of its stdout
        print(json.dumps(one_process(args)))
        return
    if args.cpu:
        result = run_cpu(args)
        title, rows = summarize_cpu(result)
    else:
        args.model = args.model or make_tiny_checkpoint(
            os.path.join(args.cache, "qwen3-0.6b-random"), "qwen3", dtype=torch.bfloat16, **QWEN3_0_6B
        )
        result = run_gpu(args)
        title, rows = summarize_gpu(result)
    width = max(len(k) for k, _ in rows)
    print(f"minivllm bench: {title}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    name = "throughput_cpu.json" if args.cpu else "first_run_gpu.json"  # GPU: first run and warm runs, bare and cached
    bm.save_json(result, args.out or os.path.join("benchmarks", "results", name))


if __name__ == "__main__":
    main()
