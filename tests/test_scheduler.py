"""The scheduler (minivllm/engine/scheduler.py), driven with Sequence objects and fake sampled tokens (no
model). Hypothesis draws workloads (prompts sharing prefixes, arrival steps, max_tokens, ignore_eos), budgets
and cache sizes; every step is checked: budgets respected, decoding sequences scheduled first, blocks
accounted (free + used = all, reference counts = holders), no write into a shared block, prefix hits only
on blocks computed from the same tokens (a shadow record of every slot), first admissions in FIFO order;
at the end every request finished exactly once with exactly the tokens an oracle predicts, and every block
is free. Both loops the engine uses are driven: synchronous (`Scheduler.postprocess`) and one
step ahead (`on_launch` now, `on_result` after the next step is scheduled)."""

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_block_manager import Shadow, check_accounting
from transformers import AutoConfig

from minivllm.config import Config
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import PENDING, Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams

EOS = 0


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    arrival: int  # the step at which it is added


def fake_token(index: int, pos: int, salt: int) -> int:
    """The token 'sampled' for request `index` at position `pos`: deterministic, EOS now and then."""
    x = (index * 1000003 + pos * 7919 + salt * 104729) % 101
    return EOS if x < 9 else 1 + x % 3


def oracle(req: Request, index: int, salt: int) -> tuple[list[int], str]:
    """The completion the engine must produce for `req`, and its finish reason."""
    out = []
    while True:
        token = fake_token(index, len(req.prompt) + len(out), salt)
        out.append(token)
        if token == EOS and not req.ignore_eos:
            return out, "stop"
        if len(out) == req.max_tokens:
            return out, "length"


@pytest.fixture(scope="module")
def hf_config(tiny_qwen3):
    return AutoConfig.from_pretrained(tiny_qwen3)


def make_scheduler(
    model: str, hf_config, num_blocks: int, bs: int, max_num_seqs: int, max_tokens: int, caching: bool = True
) -> Scheduler:
    config = Config(
        model,
        hf_config=hf_config,
        num_kvcache_blocks=num_blocks,
        kvcache_block_size=bs,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens,
        max_model_len=1024,
        enable_prefix_caching=caching,
    )
    return Scheduler(config, [EOS])


def run(sched: Scheduler, requests: list[Request], salt: int, overlap: bool) -> dict:
    """Drive `sched` to completion, checking every step. Returns per-request outputs and statistics."""
    bm, bs = sched.block_manager, sched.block_manager.block_size
    shadow = Shadow(bs)
    seqs: dict[int, Sequence] = {}  # request index -> its sequence, once added
    index = {}  # seq_id -> request index
    finished: dict[int, Sequence] = {}
    added: list[int] = []
    first_admitted: list[int] = []
    in_flight = None
    stats = dict(steps=0, chunks=0, preemptions=0, hits=0)
    preempted: set[int] = set()  # seq_ids preempted during the current schedule()
    preempt = sched.preempt

    def spy(seq: Sequence) -> None:
        preempted.add(seq.seq_id)
        preempt(seq)

    sched.preempt = spy

    def true_tokens(seq: Sequence, end: int) -> tuple[int, ...]:
        """The tokens of `seq` up to `end`, with the placeholder of a token still being sampled resolved."""
        i = index[seq.seq_id]
        return tuple(t if t != PENDING else fake_token(i, p, salt) for p, t in enumerate(seq.token_ids[:end]))

    def finish(done: list[Sequence]) -> None:
        for seq in done:
            i = index[seq.seq_id]
            assert i not in finished, f"request {i} finished twice"
            assert seq.status == SequenceStatus.FINISHED and not seq.block_table
            finished[i] = seq

    for step in range(5000):
        for i, req in enumerate(requests):
            if req.arrival == step:
                sp = SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=req.ignore_eos)
                seq = seqs[i] = Sequence(req.prompt, sp)
                index[seq.seq_id] = i
                sched.add(seq)
                added.append(i)
        arrived_all = step >= max(r.arrival for r in requests)
        if sched.is_finished() and in_flight is None:
            if arrived_all:
                break
            continue
        waiting_before = {s.seq_id for s in sched.waiting}
        decoding = [s for s in sched.running if s.num_tokens - s.num_computed_tokens == 1]
        preempted_before = sched.num_preemptions
        preempted.clear()
        scheduled = sched.schedule()
        budget = sched.max_num_batched_tokens

        # --- budgets and order ---
        assert sum(s.num_scheduled_tokens for s in scheduled) <= budget
        assert len(sched.running) <= sched.max_num_seqs and len(scheduled) <= sched.max_num_seqs
        assert scheduled or in_flight is not None, "an empty step while requests are pending"
        if len(decoding) <= budget:  # decodes go first: none is skipped for a prefill
            for s in decoding:
                assert s in scheduled or s.status == SequenceStatus.WAITING
        if sched.num_preemptions == preempted_before:
            assert all(s in scheduled for s in decoding)
        stats["preemptions"] += sched.num_preemptions - preempted_before
        for s in scheduled:
            assert s.status == SequenceStatus.RUNNING and s in sched.running
            assert 1 <= s.num_scheduled_tokens <= s.num_tokens - s.num_computed_tokens
            assert len(s.block_table) * bs >= s.num_computed_tokens + s.num_scheduled_tokens
            if s.seq_id in waiting_before | preempted:  # (re)admitted in this step: check its prefix hit
                if index[s.seq_id] not in first_admitted:
                    first_admitted.append(index[s.seq_id])
                shadow.check_hit(s)
                stats["hits"] += s.num_cached_tokens // bs
            if s.num_computed_tokens + s.num_scheduled_tokens < s.num_tokens:
                stats["chunks"] += 1
        holders = sched.running + getattr(sched, "finishing", [])
        check_accounting(bm, holders)
        assert all(not s.block_table for s in sched.waiting)

        # --- the "model": write the K/V of the scheduled tokens, then sample ---
        for s in scheduled:
            c = s.num_computed_tokens
            for p in range(c, c + s.num_scheduled_tokens):
                b = s.block_table[p // bs]
                assert bm.blocks[b].ref_count == 1, f"writing into block {b} shared by {bm.blocks[b].ref_count}"
                shadow.slots[b, p % bs] = true_tokens(s, p + 1)
        sampled = [fake_token(index[s.seq_id], s.num_tokens, salt) for s in scheduled]
        stats["steps"] += 1
        if not overlap:
            finish(sched.postprocess(scheduled, sampled))
            continue
        launched = (scheduled, sched.on_launch(scheduled), sampled) if scheduled else None
        if in_flight is not None:
            finish(sched.on_result(*in_flight))
        in_flight = launched
    else:
        raise AssertionError("the workload did not finish in 5000 steps")

    assert sorted(finished) == list(range(len(requests))), "not every request finished"
    assert first_admitted == added, f"first admissions {first_admitted} are not in arrival order {added}"
    assert bm.num_free_blocks == len(bm.blocks) and not bm.used_block_ids
    assert bm.num_prefix_hits == stats["hits"]
    for i, req in enumerate(requests):
        tokens, reason = oracle(req, i, salt)
        seq = finished[i]
        assert seq.prompt_token_ids == req.prompt
        assert (seq.completion_token_ids, seq.finish_reason) == (tokens, reason), f"request {i}"
    return stats


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    pool = draw(st.lists(st.lists(st.integers(1, 3), max_size=20), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        prompt = draw(st.sampled_from(pool)) + draw(st.lists(st.integers(1, 3), min_size=1, max_size=12))
        requests.append(Request(prompt, draw(st.integers(1, 12)), draw(st.booleans()), draw(st.integers(0, 6))))
    need = max((len(r.prompt) + r.max_tokens + bs - 1) // bs for r in requests)  # what add_request allows
    num_blocks = need + draw(st.integers(0, 8))
    return dict(
        bs=bs,
        requests=requests,
        num_blocks=num_blocks,
        max_num_seqs=draw(st.integers(1, 6)),
        max_tokens=draw(st.integers(1, 48)),
        caching=draw(st.booleans()),
        salt=draw(st.integers(0, 99)),
    )


SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "one-step-ahead"])
@SETTINGS
@given(w=workloads())
def test_random_workloads(tiny_qwen3, hf_config, overlap, w):
    sched = make_scheduler(
        tiny_qwen3, hf_config, w["num_blocks"], w["bs"], w["max_num_seqs"], w["max_tokens"], w["caching"]
    )
    stats = run(sched, w["requests"], w["salt"], overlap)
    assert stats["preemptions"] == sched.num_preemptions
    for name in ("preemptions", "chunks", "hits"):
        event(f"{name}: {'yes' if stats[name] else 'no'}")
    if not w["caching"]:
        assert stats["hits"] == 0


# --- the pressures, each shown to happen -------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "one-step-ahead"])
def test_preemption_chunking_and_prefix_hits_happen(tiny_qwen3, hf_config, overlap):
    shared = [1, 2, 3, 1, 2, 3, 1, 2]  # two full blocks
    requests = [Request(shared + [3] * k, 12, True, arrival=2 * (k // 3)) for k in range(1, 7)]
    requests.append(Request([2] * 30, 6, True, arrival=3))  # a long prompt: chunked
    sched = make_scheduler(tiny_qwen3, hf_config, num_blocks=10, bs=4, max_num_seqs=4, max_tokens=8)
    stats = run(sched, requests, salt=0, overlap=overlap)
    assert stats["preemptions"] > 0 and stats["chunks"] >= 3 and stats["hits"] > 0


def test_preempted_sequence_keeps_its_tokens_and_resumes_first(tiny_qwen3, hf_config):
    """Newest first: with room for one decoding sequence only, the newer one is preempted, goes back to the
    front of the queue with its generated tokens, and is recomputed when blocks free up."""
    sched = make_scheduler(tiny_qwen3, hf_config, num_blocks=4, bs=2, max_num_seqs=4, max_tokens=64)
    a = Sequence([1, 1, 1, 1], SamplingParams(max_tokens=5, ignore_eos=True))
    b = Sequence([2, 2, 2, 2], SamplingParams(max_tokens=5, ignore_eos=True))
    sched.add(a), sched.add(b)
    assert sched.schedule() == [a, b]  # 2 + 2 blocks
    sched.postprocess([a, b], [7, 8])
    assert sched.schedule() == [a] and sched.waiting[0] is b  # a's 3rd block: b preempted
    assert b.token_ids == [2, 2, 2, 2, 8] and b.num_computed_tokens == 0 and not b.block_table
    assert sched.num_preemptions == 1
    c = Sequence([3], SamplingParams(max_tokens=1))
    sched.add(c)
    sched.postprocess([a], [7])
    while a in sched.running:
        assert sched.schedule()[0] is a
        sched.postprocess([a], [7])
    assert sched.schedule() == [b, c]  # b first, recomputed with its token
    assert b.num_computed_tokens + b.num_scheduled_tokens == 5 and b.token_ids == [2, 2, 2, 2, 8]
