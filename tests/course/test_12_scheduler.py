"""Chapter 12: the scheduler (minivllm/engine/scheduler.py): schedule (decode first, chunked prefill under the
token budget, FIFO admission), preempt (the newest, by recompute), on_launch / on_result (tokens appended,
sequences finished on EOS and length) and finish (blocks freed). A fake model whose next token depends only on
the sequence's own tokens makes every sequence's output independent of batching and preemption: the run under a
tight cache must give what each sequence gives alone."""

import pytest
import xxhash
from transformers import AutoConfig

from minivllm.config import Config
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams

EOS = 1


def make(path: str, num_blocks: int, budget: int, max_num_seqs: int = 8, block_size: int = 4) -> Scheduler:
    config = Config(
        path,
        hf_config=AutoConfig.from_pretrained(path),
        num_kvcache_blocks=num_blocks,
        kvcache_block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=256,
        enable_prefix_caching=True,
    )
    return Scheduler(config, [EOS])


def next_token(seq: Sequence) -> int:
    """The fake model: a function of the sequence's tokens alone, never EOS unless the prompt asks (token 2)."""
    h = xxhash.xxh64_intdigest(str(seq.token_ids[: seq.num_computed_tokens + seq.num_scheduled_tokens]).encode())
    return EOS if seq.token_ids[0] == 2 and seq.num_completion_tokens >= 3 else 3 + h % 90


def drive(sched: Scheduler, seqs: list[Sequence], budget: int, max_steps: int = 500) -> list[list[Sequence]]:
    for s in seqs:
        sched.add(s)
    steps = []
    while not sched.is_finished():
        assert len(steps) < max_steps, "Scheduler.schedule: no progress after 500 steps"
        batch = sched.schedule()
        assert batch, "Scheduler.schedule: an empty step while sequences wait"
        n = sum(s.num_scheduled_tokens for s in batch)
        assert n <= budget, f"Scheduler.schedule: {n} tokens scheduled, the budget is {budget}"
        decoding = [s.num_scheduled_tokens == 1 and s.num_computed_tokens == s.num_tokens - 1 for s in batch]
        assert decoding == sorted(decoding, reverse=True), "Scheduler.schedule: decoding sequences go first"
        sched.postprocess(batch, [next_token(s) for s in batch])
        for s in batch:
            assert not (s.is_finished and s.block_table), f"Scheduler.finish: finished sequence {s.seq_id} holds blocks"
        steps.append(batch)
    return steps


def prompts() -> list[list[int]]:
    return [[5 + i] * n for i, n in enumerate((10, 30, 3, 17, 9, 22))]


def alone(path: str, prompt: list[int], max_tokens: int) -> list[int]:
    sched = make(path, num_blocks=64, budget=64)
    s = Sequence(prompt, SamplingParams(max_tokens=max_tokens))
    drive(sched, [s], 64)
    return s.completion_token_ids


def test_chunked_prefill_budget_and_order(tiny_qwen3):
    sched = make(tiny_qwen3, num_blocks=64, budget=16)
    a, b = Sequence([5] * 10, SamplingParams(max_tokens=4)), Sequence([6] * 30, SamplingParams(max_tokens=4))
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [s.num_scheduled_tokens for s in first] == [10, 6], (
        "Scheduler.schedule: budget 16, prompts of 10 and 30 tokens: expected chunks [10, 6], got "
        f"{[s.num_scheduled_tokens for s in first]}"
    )
    sched.postprocess(first, [7, 7])
    assert a.completion_token_ids == [7] and b.num_completion_tokens == 0, (
        "Scheduler.on_launch / on_result: a sequence gets a token in the step that computes its last prompt token, and "
        "only then"
    )
    second = sched.schedule()
    assert second[0] is a and [s.num_scheduled_tokens for s in second] == [1, 15], (
        "Scheduler.schedule: the decoding sequence first (1 token), then the prefill's next chunk (15): got "
        f"{[s.num_scheduled_tokens for s in second]}"
    )


@pytest.mark.parametrize("num_blocks", [40, 14], ids=["roomy cache", "tight cache (preemption)"])
def test_outputs_independent_of_batching(tiny_qwen3, num_blocks):
    max_tokens, budget = 12, 24
    sched = make(tiny_qwen3, num_blocks=num_blocks, budget=budget, max_num_seqs=5)
    seqs = [Sequence(p, SamplingParams(max_tokens=max_tokens)) for p in prompts()]
    drive(sched, seqs, budget)
    if num_blocks == 14:
        assert sched.num_preemptions > 0, "Scheduler.preempt: a cache of 14 blocks must preempt (check the check)"
    for i, s in enumerate(seqs):
        want = alone(tiny_qwen3, prompts()[i], max_tokens)
        assert s.completion_token_ids == want, (
            f"Scheduler: sequence {i} got {s.completion_token_ids}, alone it gets {want} "
            f"({sched.num_preemptions} preemptions: a preempted sequence must be recomputed, its tokens kept)"
        )
        assert s.finish_reason == "length" and s.status == SequenceStatus.FINISHED, (
            f"Scheduler.on_result: sequence {i} must finish on length, finish_reason {s.finish_reason!r}"
        )
    bm = sched.block_manager
    assert bm.num_free_blocks == num_blocks and not bm.used_block_ids, (
        f"Scheduler.finish: {num_blocks - bm.num_free_blocks} KV blocks leaked after every sequence finished"
    )


def test_eos_finishes_and_frees(tiny_qwen3):
    sched = make(tiny_qwen3, num_blocks=20, budget=32)
    stop, run_on = Sequence([2] * 6, SamplingParams(max_tokens=50)), Sequence([9] * 6, SamplingParams(max_tokens=5))
    drive(sched, [stop, run_on], 32)
    assert stop.finish_reason == "stop" and stop.completion_token_ids[-1] == EOS, (
        f"Scheduler.on_result: EOS must finish a sequence ('stop'), got {stop.finish_reason!r} after "
        f"{stop.completion_token_ids}"
    )
    assert stop.num_completion_tokens == 4, (
        f"Scheduler.on_result: the sequence stops at its EOS (4th token), got {stop.num_completion_tokens} tokens"
    )
    assert run_on.num_completion_tokens == 5 and run_on.finish_reason == "length", (
        f"Scheduler.on_launch / on_result: max_tokens=5 gives 5 tokens, got {run_on.num_completion_tokens}"
    )
    assert sched.block_manager.num_free_blocks == 20, "Scheduler.finish: KV blocks leaked"


def test_add_back_or_front(tiny_qwen3):
    sched = make(tiny_qwen3, num_blocks=8, budget=32)
    a, b, c = (Sequence([t] * 3) for t in (5, 6, 7))
    sched.add(a)
    sched.add(b)
    sched.add(c, front=True)
    assert list(sched.waiting) == [c, a, b], "Scheduler.add: a new sequence waits at the back, front=True at the front"


def test_preempt_newest_first(tiny_qwen3):
    sched = make(tiny_qwen3, num_blocks=6, budget=64, block_size=4)
    old, new = Sequence([3] * 12, SamplingParams(max_tokens=20)), Sequence([4] * 12, SamplingParams(max_tokens=20))
    sched.add(old)
    sched.add(new)
    sched.postprocess(batch := sched.schedule(), [next_token(s) for s in batch])  # both prefilled: 3 blocks each
    later = Sequence([5] * 3, SamplingParams(max_tokens=2))
    sched.add(later)
    batch = sched.schedule()  # both need a 4th block for their 13th token, none is free: 'new' goes
    assert new.status == SequenceStatus.WAITING and batch == [old], (
        "Scheduler._fit / preempt: with one block too few, the newest running sequence is preempted; scheduled "
        f"{[s.seq_id for s in batch]}, the newest is {new.status}"
    )
    assert list(sched.waiting) == [new, later], (
        "Scheduler.preempt: the preempted sequence goes back to the front of the queue, before later requests"
    )
    assert not new.block_table and new.num_computed_tokens == 0, "Scheduler.preempt: the victim's blocks are freed"
