"""The whole engine (minivllm/engine/, minivllm/llm.py): `LLM.generate` greedy output equals transformers'
greedy output on a tiny Qwen3, also when the engine is forced to preempt, to chunk prompts, to reuse the
prefix cache, and at TP=2; running sequences keep decoding while a long prompt is chunk-prefilled; stop
conditions; bad requests are refused with clear errors and leave the engine serving; TP workers never
outlive their engine or their driver process."""

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import (
    assert_greedy_within_bf16,
    bf16_greedy_margin,
    hf_greedy,
    teacher_forced_logits,
    with_generation_config,
)
from minivllm import LLM, SamplingParams
from minivllm.engine.request import StepLog
from minivllm.frontend.sampling_checks import check_sampling_params

N = 10  # tokens generated per prompt
BS = 16  # KV block size used throughout
ARGS = dict(kvcache_block_size=BS, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=256)
_gen = torch.Generator().manual_seed(0)
ID_PROMPTS = [torch.randint(1, 512, (n,), generator=_gen).tolist() for n in (1, 7, 23, 40, 52)]
SHORT_PROMPTS = [torch.randint(1, 512, (n,), generator=_gen).tolist() for n in (12, 13, 14, 15, 16)]
TEXT_PROMPTS = ["The quick brown fox", "What is the capital of France?", "minivllm is a small inference engine"]
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


# --- the transformers reference ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf(tiny_qwen3):
    """greedy(prompt, n) -> transformers' n greedy tokens (cached), and the tokenizer. Like ignore_eos: the EOS
    token is neither suppressed (min_new_tokens would) nor a stop."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    cache = {}

    def greedy(prompt: str | list[int], n: int = N) -> list[int]:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        key = (tuple(ids), n)
        if key not in cache:
            cache[key] = hf_greedy(model, ids, n)
            assert len(cache[key]) == n
        return cache[key]

    greedy.tokenizer = tokenizer
    return greedy


def engine(path: str, **kwargs) -> LLM:
    return LLM(path, **{**ARGS, "num_kvcache_blocks": 64, **kwargs})


def record_schedule(llm: LLM) -> list[list[tuple[str, int, int, int]]]:
    """Wrap the scheduler: per step, (request_id, computed, scheduled, num_tokens) of every scheduled sequence."""
    steps, schedule = [], llm.scheduler.schedule

    def wrapped():
        seqs = schedule()
        steps.append([(s.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.num_tokens) for s in seqs])
        return seqs

    llm.scheduler.schedule = wrapped
    return steps


# --- equal to transformers, also under pressure -------------------------------------------------------------


def test_greedy_matches_transformers(tiny_qwen3, hf):
    llm = engine(tiny_qwen3)
    outs = llm.generate(ID_PROMPTS + TEXT_PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf(p) for p in ID_PROMPTS + TEXT_PROMPTS]
    assert [o.prompt_token_ids for o in outs] == ID_PROMPTS + [hf.tokenizer.encode(p) for p in TEXT_PROMPTS]
    assert [o.prompt for o in outs] == [None] * len(ID_PROMPTS) + TEXT_PROMPTS
    assert {o.finish_reason for o in outs} == {"length"}
    assert outs[-1].text == hf.tokenizer.decode(outs[-1].token_ids) and outs[-1].outputs[0].text == outs[-1].text
    assert len({tuple(o.token_ids) for o in outs}) == len(outs)  # not a degenerate model
    single = llm.generate(TEXT_PROMPTS[0], GREEDY, use_tqdm=False)  # one prompt, not in a list
    assert single[0].token_ids == hf(TEXT_PROMPTS[0])
    llm.exit()


def test_preemption_keeps_outputs(tiny_qwen3, hf):
    # all five are admitted with one block each, then each needs a second one: 10 > 6 blocks
    llm = engine(tiny_qwen3, num_kvcache_blocks=6)
    outs = llm.generate(SHORT_PROMPTS, GREEDY, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [hf(p) for p in SHORT_PROMPTS]
    assert llm.scheduler.block_manager.num_free_blocks == 6  # every block came back


def test_chunked_prefill_keeps_outputs(tiny_qwen3, hf):
    llm = engine(tiny_qwen3, max_num_batched_tokens=16, max_num_seqs=4)
    steps = record_schedule(llm)
    outs = llm.generate(ID_PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf(p) for p in ID_PROMPTS]
    assert all(sum(n for _, _, n, _ in step) <= 16 for step in steps)
    assert all(len(step) <= 4 for step in steps)
    longest = outs[-1].request_id  # 52 prompt tokens
    prefill_steps = [n for step in steps for rid, done, n, _ in step if rid == longest and done < 52]
    assert len(prefill_steps) >= 4 and sum(prefill_steps) == 52  # 52 tokens in chunks of <= 16


def test_the_step_log_counts_each_steps_tokens(tiny_qwen3):
    """`step_log` (the progress bar's prefill / decode tok/s, the benchmarks' per-step figures): a prefill step
    counts its prompt chunks, a decode step one token a sequence."""
    llm = engine(tiny_qwen3, max_num_batched_tokens=16, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate(ID_PROMPTS, sp, use_tqdm=False)
    prefill = [r for r in llm.step_log if r.is_prefill]
    decode = [r for r in llm.step_log if not r.is_prefill]
    assert all(0 < r.num_tokens <= 16 for r in llm.step_log)
    assert all(r.num_tokens == r.num_seqs for r in decode)
    # every prompt token once; each step that finished a prompt also decoded the others (4 tokens each after)
    assert sum(r.num_tokens for r in llm.step_log) == sum(map(len, ID_PROMPTS)) + 4 * len(ID_PROMPTS)
    assert sum(r.num_tokens for r in prefill) >= sum(map(len, ID_PROMPTS))


def test_the_step_log_keeps_its_tail_and_a_readers_mark_stays_valid(tiny_qwen3):
    """An engine may step for days (a server, an LLM kept by a training loop): its step log drops the older
    records past its bound; a reader's mark still names the same step after a drop (the progress bar's, a
    benchmark's)."""
    llm = engine(tiny_qwen3)
    llm.step_log = StepLog(limit=8)
    llm.add_request(
        "long", {"prompt_token_ids": ID_PROMPTS[2]}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    seen = []  # (the mark before a step, the records that step added, read right after it)
    while llm.has_unfinished_requests():
        mark = llm.step_log.mark()
        llm.step()
        seen.append((mark, llm.step_log.since(mark)))
        assert len(llm.step_log) <= 8
    log = llm.step_log
    assert log.mark() > 16 and log.dropped > 0 and log.mark() == log.dropped + len(log)
    newest = log[-1]  # the last decode step of the one request
    assert not newest.is_prefill and newest.num_seqs == newest.num_tokens == 1
    assert sum(len(added) for _, added in seen) == log.mark()  # every step's records, read by marks
    for mark, added in seen:  # a mark names the same records after later drops, while they are kept
        later = log.since(mark)
        assert len(later) == min(log.mark() - mark, len(log))
        if mark >= log.dropped:
            assert all(a is b for a, b in zip(later, added)) and len(later) >= len(added)
    # the progress bar reads the log by marks across drops
    outs = llm.generate(ID_PROMPTS, GREEDY, use_tqdm=True)
    assert [len(o.token_ids) for o in outs] == [N] * len(ID_PROMPTS) and len(llm.step_log) <= 8


def test_prefix_cache_hits_keep_outputs(tiny_qwen3, hf):
    prefix = torch.randint(1, 512, (3 * BS,), generator=torch.Generator().manual_seed(1)).tolist()
    suffixes = [[7, 8, 9, 10, 11], [12, 13], [14], [15, 16, 17], [18, 19, 20, 21]]
    prompts = [prefix + s for s in suffixes]
    llm = engine(tiny_qwen3)
    bm = llm.scheduler.block_manager
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert bm.num_prefix_hits == 0
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)  # admitted together: each hits 3
    assert bm.num_prefix_hits == 3 * 4
    exact = llm.generate([prefix], GREEDY, use_tqdm=False)  # its last token is never matched
    assert bm.num_prefix_hits == 3 * 4 + 2
    assert [o.token_ids for o in first + rest + exact] == [hf(p) for p in prompts + [prefix]]
    off = engine(tiny_qwen3, enable_prefix_caching=False)
    off.generate(prompts, GREEDY, use_tqdm=False)
    assert off.scheduler.block_manager.num_prefix_hits == 0


def test_preemption_chunked_prefill_and_prefix_hits_together(tiny_qwen3, hf):
    """Six prompts that share two blocks, 16 tokens a step, 6 blocks in all: later prompts are admitted with a
    prefix hit and chunk-prefilled, the newest is preempted mid-prefill and re-admitted, hitting the shared
    blocks again, more than once. The K/V read at each hit were written by another sequence's chunks."""
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(1, 512, (2 * BS,), generator=g).tolist()
    prompts = [prefix + torch.randint(1, 512, (n,), generator=g).tolist() for n in (3, 9, 17, 5, 20, 12)]
    llm = engine(tiny_qwen3, max_num_batched_tokens=16, num_kvcache_blocks=6)
    steps = record_schedule(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf(p) for p in prompts]
    bm = llm.scheduler.block_manager
    assert llm.scheduler.num_preemptions > 0 and bm.num_prefix_hits > 0 and bm.num_free_blocks == 6
    hit_then_chunked, resumed_with_hit = set(), set()
    end = {}  # seq_id -> tokens computed after its last scheduled step
    for step in steps:
        for sid, done, n, num_tokens in step:
            if sid not in end and done > 0 and n < num_tokens - done:
                hit_then_chunked.add(sid)  # admitted with `done` tokens from the cache, the rest in chunks
            if sid in end and 0 < done < end[sid]:
                resumed_with_hit.add(sid)  # preempted (its blocks freed), re-admitted with a prefix hit
            end[sid] = done + n
    assert hit_then_chunked and resumed_with_hit, (hit_then_chunked, resumed_with_hit)


def test_bf16_engine_on_cpu_agrees_with_transformers_up_to_bf16_error(tiny_qwen3):
    """dtype="bfloat16" on CPU end to end (weights, KV cache, logits, sampler; prefix hits too). Every greedy
    token is checked given transformers' bf16 history: after a disagreement (a near tie), the engine goes on
    from the reference's tokens. It must give transformers' token wherever the fp32 logits of the two are
    further apart than twice transformers' own bf16 error (tests/conftest.py, as in test_model.py)."""
    llm = engine(tiny_qwen3, dtype="bfloat16", device="cpu")
    assert llm.model_runner.kv_cache.dtype == torch.bfloat16
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.bfloat16).eval()
    truth_model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    n = 16
    ref, ref_logits = [], []  # transformers' bf16 greedy tokens (EOS ignored) and their logits (n, vocab)
    for p in ID_PROMPTS:
        with torch.no_grad():
            run = ref_model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        ref.append(run.sequences[0, len(p) :].tolist())
        ref_logits.append(torch.cat(run.logits))
        assert ref_logits[-1].argmax(-1).tolist() == ref[-1]
    truth = [teacher_forced_logits(truth_model, p, t) for p, t in zip(ID_PROMPTS, ref)]
    margin = bf16_greedy_margin(ref_logits, truth)
    ours = [[] for _ in ID_PROMPTS]  # ours[i][s]: the engine's token given the prompt and ref[i][:s]
    while todo := [i for i, o in enumerate(ours) if len(o) < n]:
        outs = llm.generate(
            [ID_PROMPTS[i] + ref[i][: len(ours[i])] for i in todo],
            [SamplingParams(temperature=0, max_tokens=n - len(ours[i]), ignore_eos=True) for i in todo],
            use_tqdm=False,
        )
        for i, out in zip(todo, outs):
            done = len(ours[i])
            d = next((j for j, (a, b) in enumerate(zip(out.token_ids, ref[i][done:])) if a != b), n - done - 1)
            ours[i] += out.token_ids[: d + 1]  # up to the first disagreement: later tokens had another history
    compared, total = assert_greedy_within_bf16(ours, ref, truth, margin)
    assert compared >= 0.5 * total, f"only {compared} of {total} steps are clear of the margin {margin:.3f}"


# --- continuous batching: decodes are not starved by a long prompt ---------------------------------------


def test_running_sequences_decode_while_a_long_prompt_is_chunked(tiny_qwen3, hf):
    llm = engine(tiny_qwen3, max_num_batched_tokens=16)
    short_prompt, long_prompt = ID_PROMPTS[1], ID_PROMPTS[4] * 2  # 7 and 104 tokens
    sp_short = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm.add_request("short", short_prompt, sp_short)
    short = llm.requests["short"].seqs[0]
    finished = {}

    def step():
        finished.update({o.request_id: o.token_ids for o in llm.step() if o.finished})

    while short.num_completion_tokens == 0:
        step()
    llm.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    long = llm.requests["long"].seqs[0]
    chunks = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        before = short.num_completion_tokens
        step()
        chunks += 1
        assert short.num_completion_tokens == before + 1, "the running sequence skipped a step"
        assert long.num_computed_tokens <= long.num_prompt_tokens
    assert chunks >= 7  # 104 tokens, <= 15 per step
    while llm.has_unfinished_requests():
        step()
    assert finished == {"short": hf(short_prompt, 20), "long": hf(long_prompt, 3)}


# --- stop conditions, ordering, per-prompt parameters, seeds -----------------------------------------------


@pytest.fixture(scope="module")
def eos_model(tiny_qwen3, hf, tmp_path_factory) -> tuple[str, list[int]]:
    """A copy of the tiny model whose EOS row of the tied embedding is 1.01 x the row of the token greedy
    picks third, so greedy emits the real EOS <|endoftext|> there. Returns (path, prompt)."""
    path = str(tmp_path_factory.mktemp("eos_model"))
    shutil.copytree(tiny_qwen3, path, dirs_exist_ok=True)
    prompt, eos = ID_PROMPTS[2], hf.tokenizer.eos_token_id
    weights = load_file(os.path.join(path, "model.safetensors"))
    emb = weights["model.embed_tokens.weight"]
    emb[eos] = 1.01 * emb[hf(prompt)[2]]
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path, prompt


def test_eos_stops_unless_ignored_and_special_tokens_are_stripped(eos_model):
    path, prompt = eos_model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = tokenizer.eos_token_id
    ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=N, pad_token_id=eos)
    ref = ref[0, len(prompt) :].tolist()  # transformers stops at EOS too
    assert ref[-1] == eos and len(ref) < N
    llm = engine(path)
    stop, go_on = llm.generate(
        [prompt, prompt],
        [SamplingParams(temperature=0, max_tokens=N), SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)],
        use_tqdm=False,
    )
    assert stop.token_ids == ref and stop.finish_reason == "stop"
    assert go_on.token_ids[: len(ref)] == ref and len(go_on.token_ids) == N and go_on.finish_reason == "length"
    for out in (stop, go_on):
        assert "<|endoftext|>" in tokenizer.decode(out.token_ids)
        assert "<|endoftext|>" not in out.text
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_a_list_of_eos_ids_in_the_generation_config(tiny_qwen3, hf, tmp_path):
    """Qwen3's generation_config.json lists two EOS ids: a request stops at any id of the list. Here the list
    is [a later greedy token, an earlier one, <|endoftext|>]: greedy stops at the earlier one, in the middle."""
    prompt, eos = ID_PROMPTS[3], hf.tokenizer.eos_token_id
    ref = hf(prompt)
    early = next(i for i in range(2, N) if ref[i] not in ref[:i])  # first occurrences, neither the EOS
    late = next(i for i in range(early + 2, N) if ref[i] not in ref[: early + 1])
    assert eos not in ref
    path = with_generation_config(tiny_qwen3, str(tmp_path / "eos_list"), [ref[late], ref[early], eos])
    llm = engine(path)
    stop, go_on = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=N), GREEDY], use_tqdm=False)
    assert stop.token_ids == ref[: early + 1] and stop.finish_reason == "stop"
    assert go_on.token_ids == ref and go_on.finish_reason == "length"


def test_no_generation_config_the_tokenizer_eos_still_stops(eos_model, tmp_path):
    path, prompt = eos_model
    bare = with_generation_config(path, str(tmp_path / "bare"), None)
    eos = AutoTokenizer.from_pretrained(bare).eos_token_id
    stop, go_on = engine(bare).generate(
        [prompt] * 2, [SamplingParams(temperature=0, max_tokens=N), GREEDY], use_tqdm=False
    )
    assert stop.token_ids[-1] == eos and len(stop.token_ids) < N and stop.finish_reason == "stop"
    assert go_on.token_ids[: len(stop.token_ids)] == stop.token_ids and len(go_on.token_ids) == N


def test_stop_tokens_max_tokens_order_and_per_prompt_params(tiny_qwen3, hf):
    llm = engine(tiny_qwen3)
    ref = hf(ID_PROMPTS[3])
    stop_at = ref.index(ref[4])
    params = [
        SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),  # finishes last
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, stop_token_ids=[ref[4]]),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    ]
    prompts = [ID_PROMPTS[0], ID_PROMPTS[1], ID_PROMPTS[3], ID_PROMPTS[4]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts  # input order
    assert [o.token_ids for o in outs] == [hf(prompts[0]), hf(prompts[1])[:1], ref[: stop_at + 1], hf(prompts[3])[:4]]
    assert [o.finish_reason for o in outs] == ["length", "length", "stop", "length"]
    with pytest.raises(ValueError, match="2 sampling params for 4 prompts"):
        llm.generate(prompts, params[:2], use_tqdm=False)
    assert llm.is_finished()


def test_seeded_sampling_is_reproducible(tiny_qwen3):
    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=N, ignore_eos=True)

    def sample(seed: int) -> list[list[int]]:
        llm = engine(tiny_qwen3, seed=seed)
        return [o.token_ids for o in llm.generate(ID_PROMPTS[:3], sp, use_tqdm=False)]

    a, b, c = sample(1), sample(1), sample(2)
    assert a == b
    assert a != c


# --- bad input: a clear error, and the engine keeps serving ------------------------------------------------


@pytest.mark.parametrize(
    "prompt, sp, message",
    [
        ([], GREEDY, "empty prompt"),
        ("", GREEDY, "empty prompt"),
        (list(range(1, 101)), SamplingParams(max_tokens=40), "exceeds max_model_len 128"),
        (list(range(1, 61)), SamplingParams(max_tokens=10), "needs 5 KV blocks; the cache has only 4"),
        ([5, 512], GREEDY, r"token ids \[512\] are outside the vocabulary \[0, 512\)"),
        ([-1, 5], GREEDY, r"token ids \[-1\] are outside the vocabulary"),
        ([5], "greedy", "sampling params must be a SamplingParams"),
    ],
)
def test_bad_request_is_refused_and_the_engine_keeps_serving(tiny_qwen3, hf, prompt, sp, message):
    llm = engine(tiny_qwen3, num_kvcache_blocks=4)
    good = ID_PROMPTS[2]
    with pytest.raises((ValueError, TypeError), match=message):
        llm.generate([good, prompt], [GREEDY, sp], use_tqdm=False)
    assert llm.is_finished()  # nothing of the batch was queued
    # add_request: the refused one never enters the queue, the queued ones complete
    llm.add_request("first", good, GREEDY)
    with pytest.raises((ValueError, TypeError), match=message):
        llm.add_request("bad", prompt, sp)
    llm.add_request("second", ID_PROMPTS[1], GREEDY)
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
    assert done == {"first": hf(good), "second": hf(ID_PROMPTS[1])}
    assert llm.generate([good], GREEDY, use_tqdm=False)[0].token_ids == hf(good)  # and the next call works


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be an integer >= 0"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):  # checked where a request is accepted (the Processor)
        check_sampling_params(SamplingParams(**kwargs))


def test_unknown_engine_arguments_are_named(tiny_qwen3):
    with pytest.raises(TypeError, match=r"unknown engine argument\(s\) \['max_num_seq', 'temprature'\]"):
        LLM(tiny_qwen3, max_num_seq=4, temprature=0.5)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(os.path.join(tiny_qwen3, "missing"))
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        LLM(tiny_qwen3, max_num_seqs=0)


# --- tensor-parallel workers --------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_two_tp2_engines_coexist_and_exit_cleanly(tiny_qwen3, hf):
    a = engine(tiny_qwen3, tensor_parallel_size=2)
    b = engine(tiny_qwen3, tensor_parallel_size=2, num_kvcache_blocks=6)  # b preempts as well
    workers = [p.pid for p in a.workers.processes + b.workers.processes]
    assert len(set(workers)) == 2 and all(alive(pid) for pid in workers)
    assert [o.token_ids for o in a.generate(ID_PROMPTS, GREEDY, use_tqdm=False)] == [hf(p) for p in ID_PROMPTS]
    assert [o.token_ids for o in b.generate(SHORT_PROMPTS, GREEDY, use_tqdm=False)] == [hf(p) for p in SHORT_PROMPTS]
    assert b.scheduler.num_preemptions > 0
    a.exit()
    assert [o.token_ids for o in b.generate(TEXT_PROMPTS, GREEDY, use_tqdm=False)] == [hf(p) for p in TEXT_PROMPTS]
    b.exit()
    assert not any(alive(pid) for pid in workers)
    assert not {p.pid for p in multiprocessing.active_children()} & set(workers)
    single = engine(tiny_qwen3)  # TP=1 after TP engines in this process
    assert single.generate(ID_PROMPTS[:1], GREEDY, use_tqdm=False)[0].token_ids == hf(ID_PROMPTS[0])


DRIVER = textwrap.dedent("""
    import sys, time
    from minivllm import LLM, SamplingParams
    llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=64,
              max_num_batched_tokens=64, max_num_seqs=2)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    print(*[p.pid for p in llm.workers.processes], flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
def test_workers_exit_when_the_driver_is_killed(tiny_qwen3):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, tiny_qwen3], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(workers) == 1 and alive(workers[0])
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.time() + 10
    while any(alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers), "a TP worker outlived its killed driver"


# --- on a GPU: the decode graph holds the whole step (feeding, model, LM head, sampler) ---------------------


@pytest.mark.gpu
def test_gpu_graphs_captured_without_their_own_warm_up_equal_eager(tiny_qwen3):
    """Capture runs an eager warm-up only for the first batch size of each kernel variant (model_runner.py
    capture_cudagraph). Batches that replay the other sizes' graphs (with the tiny model's two KV heads sizes 2-8
    share a variant, and 48-64) must decode the same greedy tokens as eager steps."""
    from minivllm.engine.cuda_graphs import graph_batch_sizes
    from minivllm.kernels import decode_graph_variant

    prompts = [
        torch.randint(1, 512, (1 + (5 * i) % 37,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(64)
    ]
    kw = dict(device="cuda", dtype="float32", max_model_len=128, max_num_seqs=64, num_kvcache_blocks=256)
    runs = {}
    for eager in (True, False):
        llm = LLM(tiny_qwen3, enforce_eager=eager, **kw)
        if not eager:
            hkv = llm.config.hf_config.num_key_value_heads
            sizes = graph_batch_sizes(64)
            assert sorted(llm.model_runner.graphs.graphs) == sizes
            variants = [decode_graph_variant(bs, hkv) for bs in sizes]
            assert len(set(variants)) < len(sizes)  # some sizes were captured without a warm-up of their own
        runs[eager] = [
            [o.token_ids for o in llm.generate(prompts[:n], GREEDY, use_tqdm=False)] for n in (64, 40, 20, 3)
        ]
        llm.exit()
    assert runs[True] == runs[False]


@pytest.mark.gpu
def test_gpu_graph_steps_equal_eager_steps_greedy_and_sampled(tiny_qwen3, hf):
    """fp32 on CUDA: with CUDA graphs the sampler runs inside the graph from a device-side seed; with the same
    seed, graphs and eager steps must draw the same tokens (greedy, and at temperature 0.8), and greedy must
    equal transformers. Top-k rows leave the graph's draw for an eager one: still reproducible."""
    kw = dict(device="cuda", dtype="float32", num_kvcache_blocks=64)
    hot = SamplingParams(temperature=0.8, max_tokens=N, ignore_eos=True)
    topk = SamplingParams(temperature=0.8, top_k=5, max_tokens=N, ignore_eos=True)
    runs = {}
    for eager in (True, False):
        llm = engine(tiny_qwen3, enforce_eager=eager, seed=5, **kw)
        assert llm.model_runner.sample_in_graph == (not eager)
        # sampled first: an all-greedy eager step skips the noise (no seed step) where a graph step draws it
        runs[eager] = [[o.token_ids for o in llm.generate(ID_PROMPTS, sp, use_tqdm=False)] for sp in (hot, GREEDY)]
        llm.exit()
    assert runs[True][1] == runs[False][1] == [hf(p) for p in ID_PROMPTS]
    assert runs[True][0] == runs[False][0]
    assert runs[False][0] != runs[False][1]  # it really sampled
    topk_runs = []
    for _ in range(2):
        llm = engine(tiny_qwen3, seed=5, **kw)
        topk_runs.append([o.token_ids for o in llm.generate(ID_PROMPTS, topk, use_tqdm=False)])
        llm.exit()
    assert topk_runs[0] == topk_runs[1]
