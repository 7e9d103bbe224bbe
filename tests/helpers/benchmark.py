"""What the benchmarks share (bench.py, benchmarks/, scripts/ and notebook 15): nano-vllm's benchmark
workload (and the CPU comparison's chat prompts and transformers reference), the roofline floor of a run from the
machine's measured ceilings, per-phase times from the engine's step log, what bench.py records of an engine's start,
and JSON results that carry their date, command and package versions."""

import datetime
import json
import os
import platform
import random
import statistics
import sys
import threading
import time

import torch

from minivllm.sampling_params import SamplingParams

COPY_BW = 4.28e12  # bytes/s, device-to-device copy on the H200, as measured there
MATMUL_FLOPS = 700e12  # bf16 dense matmul on the H200


CHAT_QUESTIONS = [  # bench.py --cpu's prompts, one chat turn each
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


def graph_replay_us(fn, per: int = 1, replays: int = 15) -> float:
    """Median microseconds of one replay of `fn()` captured once in a CUDA graph, divided by `per` (the calls or
    layers `fn` runs): one eager call first (compiles, warms up), then `replays` timed replays after 3 untimed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per)
    return statistics.median(times[3:])


def workload(
    seed: int,
    num_seqs: int,
    min_len: int,
    max_input: int,
    max_output: int,
    temperature: float = 0.6,
    max_id: int = 10000,
):
    random.seed(seed)
    prompts = [[random.randint(0, max_id) for _ in range(random.randint(min_len, max_input))] for _ in range(num_seqs)]
    params = [
        SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=random.randint(min_len, max_output))
        for _ in range(num_seqs)
    ]
    return prompts, params


def model_bytes_and_flops(hf) -> tuple[int, int, int]:
    """(KV bytes per token, weight bytes read per decode step, matmul params) for a bf16 Qwen3."""
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 2
    h, i, L = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    q, kv = hf.num_attention_heads * head_dim, hf.num_key_value_heads * head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + 2 * head_dim
    params = L * layer + h + hf.vocab_size * h  # embedding counted once (tied)
    return kv_per_token, 2 * params, params


def roofline(hf, prompt_lens: list[int], output_lens: list[int]) -> dict:
    """Lower bound in seconds: every decode step reads the weights and each running sequence's KV cache at
    copy bandwidth; prefill is matmul-bound (2 x params x prompt tokens, plus causal attention)."""
    kv_per_token, weight_bytes, params = model_bytes_and_flops(hf)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_bytes, steps = 0, max(output_lens) - 1  # the first token comes from prefill
    for p, o in zip(prompt_lens, output_lens):
        kv_bytes += kv_per_token * sum(p + s for s in range(1, o))  # decode step s reads p + s keys
    attn_flops = sum(2 * 2 * hf.num_hidden_layers * hf.num_attention_heads * head_dim * p * p / 2 for p in prompt_lens)
    prefill_flops = 2 * params * sum(prompt_lens) + attn_flops
    t_kv, t_w, t_pre = kv_bytes / COPY_BW, steps * weight_bytes / COPY_BW, prefill_flops / MATMUL_FLOPS
    return dict(
        kv_read_s=t_kv,
        weights_s=t_w,
        prefill_s=t_pre,
        floor_s=t_kv + t_w + t_pre,
        decode_steps=steps,
        kv_bytes_per_token=kv_per_token,
        weight_bytes=weight_bytes,
    )


def phase_times(log: list) -> dict:
    """Seconds per phase of a run's StepRecords (`llm.step_log.since(mark)`): schedule, run, postprocess."""
    pre = [r for r in log if r.is_prefill]
    dec = [r for r in log if not r.is_prefill]
    return dict(
        prefill_steps=len(pre),
        decode_steps=len(dec),
        prefill_s=sum(r.schedule + r.run + r.postprocess for r in pre),
        decode_s=sum(r.schedule + r.run + r.postprocess for r in dec),
        schedule_s=sum(r.schedule for r in log),
        run_s=sum(r.run for r in log),
        postprocess_s=sum(r.postprocess for r in log),
    )


def versions() -> dict:
    import importlib.metadata as md

    v = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda)
    for name, dist in (
        ("triton", "triton"),
        ("transformers", "transformers"),
        ("flash_attn", "flash-attn"),
        ("flash_attn_4", "flash-attn-4"),
    ):
        try:
            v[name] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return v


def save_json(result: dict, out: str) -> None:
    """Write a benchmark result with its date, command and versions (every recorded run carries them)."""
    result.update(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        versions=versions(),
    )
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {out}")


def decode_kernel(runner) -> str:
    """Which kernel decodes: the torch backend's, ours (Triton) or the flash backend's own."""
    return "torch" if runner.backend.name == "torch" else ("triton" if runner.ops.paged_decode else "flash")


def engine_facts(llm, counter) -> dict:
    """What bench.py records of an engine it has just started: the seconds of each start-up phase, the attention
    backend and decode kernel, the KV cache's blocks, the GPU, and the Triton compiles `counter` (a
    CompileCounter made before the engine) saw in init: [kernel, seconds, thread] and [kernel, specialisation
    key] each, and how many ran on the main thread (the engine compiles its kernels on threads of its own, so a
    compile there is one the start waited for). The one reader of engine internals for bench.py."""
    runner = llm.model_runner
    compiles = [
        [name, round(s, 3), thread]
        for name, s, thread in zip(counter.triton_kernels, counter.triton_seconds, counter.triton_threads)
    ]
    return dict(
        startup_phases=dict(runner.startup_seconds),
        init_triton_compiles=compiles,
        init_triton_keys=[[name, key] for name, key in zip(counter.triton_kernels, counter.triton_keys)],
        init_main_thread_compiles=sum(thread == threading.main_thread().name for _, _, thread in compiles),
        backend=runner.backend.name,
        decode_kernel=decode_kernel(runner),
        kv_cache_blocks=llm.config.num_kvcache_blocks,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )


def transformers_greedy(model: str, prompts: list[list[int]], max_tokens: int, dtype: str, pad: int):
    """bench.py --cpu's reference: transformers' batched greedy `generate` of exactly `max_tokens` new tokens per
    prompt (left-padded), timed after a 4-token warm-up. Returns (seconds, the new tokens of each prompt)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # (num_prompts, width), left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    hf.generate(input_ids=ids[:1], attention_mask=mask[:1], do_sample=False, max_new_tokens=4, pad_token_id=pad)
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=pad,
        )
    return time.perf_counter() - t, out[:, width:].tolist()


def greedy_agreement(tokens: list[list[int]], reference: list[list[int]], eos: set[int]) -> int:
    """How many sequences equal the reference's tokens up to the first EOS the engine sampled (the engine's
    ignore_eos may pick EOS and go on, where transformers' min_new_tokens masks it)."""
    same = 0
    for ours, ref in zip(tokens, reference):
        cut = next((i for i, t in enumerate(ours) if t in eos), len(ours))
        same += ours[:cut] == ref[:cut]
    return same
