"""Throughput benchmark on nano-vllm's workload (its bench.py): 256 prompts of random token ids, lengths
uniform in [100, 1024], temperature 0.6, ignore_eos, max_tokens uniform in [100, 1024]; throughput =
generated tokens / wall time. The model is a random-weight checkpoint with Qwen3-0.6B's exact config, made
here when --model is not given (no hub). Prints a table and writes JSON; also computes the workload's
roofline floor from the sampled lengths and the machine's ceilings.

  python bench.py                        # the H200 workload (CUDA graphs, fastest attention backend)
  python bench.py --cpu                  # a small CPU workload vs transformers' generate on the same prompts
"""

import argparse
import os
import random
import time

import torch

from minivllm import LLM, SamplingParams
from minivllm.layers import attention_backend
from minivllm.testing.benchmark import phase_times, roofline, save_json, workload
from minivllm.testing.tiny_model import QWEN3_0_6B, make_tiny_checkpoint
from minivllm.utils import pdl, switches


def run_gpu(args) -> dict:
    model = args.model or make_tiny_checkpoint(
        os.path.join(args.cache, "qwen3-0.6b-random"), "qwen3", dtype=torch.bfloat16, **QWEN3_0_6B
    )
    if args.decode_kernel:  # the environment reaches the spawned TP workers too
        os.environ[switches.env_name("decode_kernel")] = args.decode_kernel
        switches.set(decode_kernel=args.decode_kernel)
    llm = LLM(
        model,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tp,
        attention_backend=args.backend,
        max_model_len=4096,
    )
    prompts, params = workload(0, args.num_seqs, 100, args.max_input_len, args.max_output_len)
    warm_prompts, _ = workload(1, args.num_seqs, 100, args.max_input_len, args.max_output_len)
    warm_params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(1, 64)) for _ in warm_prompts
    ]
    llm.generate(warm_prompts, warm_params, use_tqdm=False)  # compile, JIT, every graph size, sampler
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = len(llm.step_log)
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outputs)
    assert tokens == sum(p.max_tokens for p in params), "every request must produce exactly max_tokens tokens"
    floor = roofline(llm.config.hf_config, [len(p) for p in prompts], [p.max_tokens for p in params])
    decode_steps = [(r.num_seqs, r.schedule + r.run + r.postprocess) for r in llm.step_log[start:] if not r.is_prefill]
    result = dict(
        tokens=tokens,
        seconds=elapsed,
        tok_per_s=tokens / elapsed,
        floor=floor,
        floor_tok_per_s=tokens / floor["floor_s"],
        measured_over_floor=elapsed / floor["floor_s"],
        phases=phase_times(llm, start),
        decode_step_times=decode_steps,
        peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30,
        kv_cache_blocks=llm.config.num_kvcache_blocks,
        backend=llm.model_runner.backend,
        decode_kernel=attention_backend.decode_kernel(llm.model_runner.backend),
        device=torch.cuda.get_device_name(),
        num_seqs=args.num_seqs,
        enforce_eager=args.enforce_eager,
        tp=args.tp,
        pdl=pdl.enabled(torch.zeros(1, device="cuda")),
    )
    llm.exit()
    return result


def run_cpu(args) -> dict:
    from transformers import AutoModelForCausalLM

    model = args.model or make_tiny_checkpoint(
        os.path.join(args.cache, "qwen3-tiny-bench"),
        "qwen3",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        vocab_size=4096,
    )
    prompts, _ = workload(0, args.num_seqs, 16, args.max_input_len, args.max_output_len, max_id=4095)
    n = args.max_output_len
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=n)
    llm = LLM(model, kvcache_block_size=16)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    t_engine = time.perf_counter() - t
    llm.exit()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    ref = hf.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
    )
    t_hf = time.perf_counter() - t
    same = sum(o.token_ids == r[width:].tolist() for o, r in zip(outputs, ref))
    tokens = len(prompts) * n
    return dict(
        tokens=tokens,
        seconds=t_engine,
        tok_per_s=tokens / t_engine,
        hf_seconds=t_hf,
        hf_tok_per_s=tokens / t_hf,
        speedup=t_hf / t_engine,
        greedy_identical=f"{same}/{len(prompts)}",
        device="cpu",
        num_seqs=args.num_seqs,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir (default: a random Qwen3-0.6B-shaped model made here)")
    ap.add_argument("--cpu", action="store_true", help="small CPU workload, compared with transformers' generate")
    ap.add_argument("--num-seqs", type=int, default=None)
    ap.add_argument("--max-input-len", type=int, default=None)
    ap.add_argument("--max-output-len", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--backend", choices=["fa4", "flash_attn", "torch"], default=None, help="attention backend")
    ap.add_argument(
        "--decode-kernel",
        choices=["triton", "flash"],
        default=None,
        help="decode attention with the flash backends: our Triton kernel (default) or the backend's own",
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    ap.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "minivllm"))
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/throughput_<device>.json)")
    args = ap.parse_args()
    cpu = args.cpu or not torch.cuda.is_available()
    defaults = (32, 256, 128) if cpu else (256, 1024, 1024)
    args.num_seqs = args.num_seqs or defaults[0]
    args.max_input_len = args.max_input_len or defaults[1]
    args.max_output_len = args.max_output_len or defaults[2]
    result = run_cpu(args) if cpu else run_gpu(args)
    rows = [
        ("output tokens", result["tokens"]),
        ("seconds", f"{result['seconds']:.2f}"),
        ("output tok/s", f"{result['tok_per_s']:.0f}"),
    ]
    if cpu:
        rows += [
            ("transformers seconds", f"{result['hf_seconds']:.2f}"),
            ("transformers tok/s", f"{result['hf_tok_per_s']:.0f}"),
            ("speed-up", f"{result['speedup']:.1f}x"),
            ("greedy tokens identical", result["greedy_identical"]),
        ]
    else:
        f, ph = result["floor"], result["phases"]
        rows += [
            (
                "roofline floor s (kv/weights/prefill)",
                f"{f['floor_s']:.2f} ({f['kv_read_s']:.2f}/{f['weights_s']:.2f}/{f['prefill_s']:.2f})",
            ),
            ("floor tok/s", f"{result['floor_tok_per_s']:.0f}"),
            ("measured / floor", f"{result['measured_over_floor']:.2f}"),
            ("prefill steps / s", f"{ph['prefill_steps']} / {ph['prefill_s']:.2f}"),
            ("decode steps / s", f"{ph['decode_steps']} / {ph['decode_s']:.2f}"),
            ("host: schedule / postprocess s", f"{ph['schedule_s']:.2f} / {ph['postprocess_s']:.2f}"),
            ("peak GPU memory GiB", f"{result['peak_memory_gib']:.1f}"),
            ("backend", result["backend"]),
        ]
    width = max(len(k) for k, _ in rows)
    print(f"minivllm bench on {result['device']}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    save_json(result, args.out or os.path.join("benchmarks", "results", f"throughput_{'cpu' if cpu else 'gpu'}.json"))


if __name__ == "__main__":
    main()
