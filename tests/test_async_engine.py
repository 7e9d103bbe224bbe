"""Random arrivals and aborts through the engine's step API (engine/llm_engine.py) and through the async loop
(serve/async_llm.py), checked against the scheduler's invariants. The model runner is replaced by a fake
that builds each step's real inputs (step_inputs.py) and "samples" a token that depends only on the
sequence and the position, so an oracle knows every output; hypothesis draws the workloads (prompts sharing
prefixes, arrival and abort times, n, max_tokens, min_tokens, stop tokens, ignore_eos, penalties, output
kinds), the cache and budgets, and whether the engine runs one step ahead.

After every step: free + used blocks = all, reference counts = holders, waiting sequences hold no block, every
token a step reads from the cache was computed from this sequence's own prefix (a shadow of every slot), a
PENDING token is fed from the previous step's row of the same sequence, and a request with penalties never
has one. At the end: every block is free and each request finished exactly once (with the oracle's tokens,
whatever its output kind) or was aborted, with no output after either.

Examples per run (`pytest --hypothesis-show-statistics` counts them): this file 250 + 60, the scheduler's
random workloads 2 x 250 (tests/test_scheduler.py), the block manager's state machine 250
(tests/test_block_manager.py): 1,060 random workloads in all."""

import asyncio
import copy
import time
import zlib
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_block_manager import check_accounting

from minivllm import LLM, SamplingParams
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import PENDING, Sequence
from minivllm.engine.step_inputs import prepare_decode, prepare_prefill
from minivllm.frontend.output_processor import OutputProcessor
from minivllm.frontend.penalties import needs_history
from minivllm.sampling_params import RequestOutputKind
from minivllm.serve.async_llm import AsyncLLM, EngineDeadError

EOS = 0  # the tiny model's <|endoftext|>
KINDS = list(RequestOutputKind)


def fake_token(request_id: str, index: int, pos: int) -> int:
    """The token 'sampled' for sequence `index` of a request at position `pos`: EOS now and then."""
    x = zlib.crc32(f"{request_id}/{index}/{pos}".encode()) % 97
    return EOS if x < 8 else 1 + x % 5


class Handle:
    prompt_logprobs = None  # no request here asks for prompt logprobs

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def result(self) -> tuple[list[int], dict]:
        return self.tokens, {}


class FakeRunner:
    """ModelRunner.launch without a model: real inputs, checked; the KV 'written' is the tokens' prefix."""

    def __init__(self, engine, block_size: int, delay: float = 0.0) -> None:
        self.engine, self.bs, self.delay = engine, block_size, delay
        # the engine thread selects the runner's device (a GPU engine's: its first GPU)
        self.device = torch.device("cuda", 0) if engine.config.device == "cuda" else torch.device("cpu")
        self.seen: dict[int, Sequence] = {}  # every sequence scheduled, by id
        self.slots: dict[tuple[int, int], tuple] = {}  # (block, offset) -> the prefix its K/V came from
        self.previous: list[Sequence] = []
        self.eos = [EOS]

    def true_tokens(self, seq: Sequence, end: int) -> tuple:
        return tuple(t if t != PENDING else fake_token(seq.request_id, seq.index, p) for p, t in enumerate(seq[:end]))

    def launch(self, seqs: list[Sequence], is_prefill: bool, hook=None) -> Handle:
        bm = self.engine.scheduler.block_manager
        inputs = prepare_prefill(seqs, self.bs) if is_prefill else prepare_decode(seqs, self.bs, rows=len(seqs))
        owners = [s for s in seqs for _ in range(s.num_scheduled_tokens)]  # the sequence of each input token
        for t, src in enumerate(inputs.src if inputs.src is not None else []):
            if src >= 0:  # fed from the previous step's output: that row must be this very sequence
                assert self.previous[src] is owners[t], "a PENDING token fed from another sequence's row"
        for s in seqs:
            assert not (needs_history(s.sampling_params) and PENDING in s.token_ids), "penalties without history"
            for p in range(s.num_computed_tokens):  # what attention reads from the cache
                slot = (s.block_table[p // self.bs], p % self.bs)
                assert self.slots.get(slot) == self.true_tokens(s, p + 1), f"slot {slot} holds another prefix"
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens):
                block = s.block_table[p // self.bs]
                assert bm.blocks[block].ref_count == 1, f"writing into shared block {block}"
                self.slots[block, p % self.bs] = self.true_tokens(s, p + 1)
        for i, s in enumerate(seqs):
            s.sample_row = i
            self.seen[s.seq_id] = s
        self.previous = list(seqs)
        time.sleep(self.delay)  # the "GPU" (the async test gives clients time to react mid-stream)
        return Handle([fake_token(s.request_id, s.index, s.num_tokens) for s in seqs])

    def exit(self) -> None:
        pass


@dataclass
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrival: int  # step (or, async, delay) at which it is added
    abort_at: int | None  # step after which it is aborted (None: never)


def oracle(req: Req, index: int) -> list[int]:
    sp, out = req.params, []
    while True:
        token = fake_token(req.rid, index, len(req.prompt) + len(out))
        out.append(token)
        if len(out) >= sp.min_tokens and ((token == EOS and not sp.ignore_eos) or token in sp.stop_token_ids):
            return out
        if len(out) == sp.max_tokens:
            return out


@st.composite
def workloads(draw, max_requests: int = 7):
    bs = draw(st.sampled_from([2, 4, 8]))
    pool = draw(st.lists(st.lists(st.integers(1, 5), max_size=16), min_size=1, max_size=3))
    reqs = []
    for i in range(draw(st.integers(1, max_requests))):
        prompt = draw(st.sampled_from(pool)) + draw(st.lists(st.integers(1, 5), min_size=1, max_size=10))
        abort_at = draw(st.one_of(st.none(), st.none(), st.integers(0, 12)))
        max_tokens = draw(st.integers(1, 10) if abort_at is None else st.integers(1, 30))
        n = draw(st.sampled_from([1, 1, 2]))
        params = SamplingParams(
            n=n,
            temperature=1.0 if n > 1 else 0.0,
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.sampled_from([[], [3]])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.2])),
            output_kind=draw(st.sampled_from(KINDS)),
        )
        reqs.append(Req(f"r{i}", prompt, params, draw(st.integers(0, 6)), abort_at))
    need = max((len(r.prompt) + r.params.max_tokens + bs - 1) // bs for r in reqs)  # what add_request allows
    return dict(
        bs=bs,
        reqs=reqs,
        num_blocks=need + draw(st.integers(0, 6)),
        max_num_seqs=draw(st.integers(1, 5)),
        max_num_batched_tokens=draw(st.integers(1, 40)),
        caching=draw(st.booleans()),
        overlap=draw(st.booleans()),
    )


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    llm = LLM(tiny_qwen3, num_kvcache_blocks=4, kvcache_block_size=4, max_model_len=256)
    assert llm.eos == [EOS]
    yield llm
    llm.exit()


def reset(engine, w: dict, delay: float = 0.0) -> FakeRunner:
    """The module's engine with a fresh scheduler of the workload's cache and budgets, and a fake runner."""
    engine.config = replace(
        engine.config,
        kvcache_block_size=w["bs"],
        num_kvcache_blocks=w["num_blocks"],
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=w["max_num_batched_tokens"],
        enable_prefix_caching=w["caching"],
    )
    engine.scheduler = Scheduler(engine.config, engine.eos)
    engine.requests, engine.in_flight, engine.overlap = {}, None, w["overlap"]
    engine.output_processor = OutputProcessor(engine.tokenizer)
    engine.model_runner = FakeRunner(engine, w["bs"], delay)
    return engine.model_runner


def check_step(engine) -> None:
    s = engine.scheduler
    check_accounting(s.block_manager, s.running + s.finishing)
    assert all(not q.block_table for q in s.waiting)
    for seq in engine.model_runner.seen.values():
        if seq.is_finished:  # left the batch: no block, no placeholder of a token that will never come
            assert not seq.block_table and PENDING not in seq.token_ids and seq.num_tokens == len(seq.token_ids)


class Collector:
    """Every output of every request: no output after the finished one, DELTA / CUMULATIVE consistent."""

    def __init__(self, reqs: list[Req]) -> None:
        self.reqs = {r.rid: r for r in reqs}
        self.tokens = {r.rid: {} for r in reqs}  # rid -> index -> tokens so far
        self.finished: dict[str, int] = {}
        self.aborted: set[str] = set()

    def take(self, out) -> None:
        rid = out.request_id
        assert rid not in self.finished and rid not in self.aborted, f"{rid}: output after it ended"
        kind = self.reqs[rid].params.output_kind
        assert kind != RequestOutputKind.FINAL_ONLY or out.finished
        for c in out.outputs:
            if c.finish_reason == "abort":
                continue
            before = self.tokens[rid].get(c.index, [])
            if kind == RequestOutputKind.DELTA:
                self.tokens[rid][c.index] = before + c.token_ids
            else:
                assert c.token_ids[: len(before)] == before
                self.tokens[rid][c.index] = c.token_ids
        if out.finished:
            if any(c.finish_reason == "abort" for c in out.outputs):
                self.aborted.add(rid)
            else:
                self.finished[rid] = 1

    def check(self) -> None:
        for rid, req in self.reqs.items():
            assert (rid in self.finished) != (rid in self.aborted), f"{rid}: finished or aborted, exactly once"
            if rid in self.finished:
                expected = {i: oracle(req, i) for i in range(req.params.n)}
                assert self.tokens[rid] == expected, rid


def all_free(engine) -> bool:
    bm = engine.scheduler.block_manager
    return bm.num_free_blocks == len(bm.blocks) and not bm.used_block_ids and not engine.requests


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(max_examples=250, **SETTINGS)
@given(w=workloads())
def test_step_api_random_arrivals_and_aborts(engine, w):
    reset(engine, w)
    collector = Collector(w["reqs"])
    for step in range(2000):
        for r in w["reqs"]:
            if r.arrival == step:
                engine.add_request(r.rid, r.prompt, r.params)
            if r.abort_at is not None and r.arrival + r.abort_at == step and r.rid in engine.requests:
                engine.abort_request(r.rid)
                collector.aborted.add(r.rid)
        if engine.has_unfinished_requests():
            for out in engine.step():
                collector.take(out)
        check_step(engine)
        if step > max(r.arrival for r in w["reqs"]) and not engine.has_unfinished_requests():
            break
    else:
        raise AssertionError("the workload did not finish in 2000 steps")
    assert all_free(engine)
    collector.check()
    events(engine, collector)


def events(engine, collector: Collector) -> None:
    """What the workload made happen (hypothesis --hypothesis-show-statistics lists them)."""
    for name, happened in (
        ("aborted", collector.aborted),
        ("preempted", engine.scheduler.num_preemptions),
        ("prefix hits", engine.scheduler.block_manager.num_prefix_hits),
    ):
        event(f"{name}: {'yes' if happened else 'no'}")


@settings(max_examples=60, **SETTINGS)
@given(w=workloads(max_requests=6))
def test_async_loop_random_arrivals_and_aborts(engine, w):
    """The same workloads through AsyncLLM: each request is a task that arrives after `arrival` event-loop
    turns; aborts come from llm.abort (odd abort times) or from closing the stream (even ones). The
    invariants are checked in the engine thread after every step."""
    runner = reset(engine, w, delay=0.001)
    violations = []
    closed: dict[str, int] = {}  # request id -> tokens received when its stream was closed

    def checked_step():
        outputs = LLM.step(engine)
        try:
            check_step(engine)
        except AssertionError as e:
            violations.append(e)
        return outputs

    engine.step = checked_step
    llm = AsyncLLM(engine)
    collector = Collector(w["reqs"])

    async def client(r: Req) -> None:
        for _ in range(r.arrival):
            await asyncio.sleep(0)
        stream = llm.generate(r.prompt, r.params, r.rid)
        received = 0
        async for out in stream:
            collector.take(out)
            received += 1
            if r.abort_at is not None and received > r.abort_at // 2 and not out.finished:
                if r.abort_at % 2:
                    llm.abort(r.rid)  # the stream ends with an "abort" output
                else:
                    await stream.aclose()  # the consumer goes away
                    collector.aborted.add(r.rid)
                    closed[r.rid] = max(map(len, collector.tokens[r.rid].values()), default=0)
                    return

    async def main() -> None:
        await asyncio.gather(*[client(r) for r in w["reqs"]])

    try:
        asyncio.run(main())
        deadline = time.time() + 10  # a closed stream's abort reaches the engine at its next gap between steps
        while not all_free(engine) and time.time() < deadline:
            time.sleep(0.005)
        assert not llm.streams  # (the engine thread is idle now) every stream was let go
    finally:
        llm.shutdown()
        del engine.step
    assert not violations, violations[0]
    assert all_free(engine)
    collector.check()
    for seq in runner.seen.values():  # a closed stream aborted its request within the steps already under way
        if seq.request_id in closed:
            assert seq.finish_reason == "abort" or len(seq.output_token_ids) <= closed[seq.request_id] + 3
    events(engine, collector)


def run_first_output(llm: AsyncLLM, prompt: list[int]):
    """The first output of a request, or the error its stream ends with; a stream nobody answers fails the
    test after 10 s instead of hanging it."""

    async def first():
        async for out in llm.generate(prompt, SamplingParams(max_tokens=2), "r0"):
            return out

    return asyncio.run(asyncio.wait_for(first(), timeout=10))


def test_an_engine_thread_that_fails_to_start_fails_the_requests(tiny_qwen3, monkeypatch):
    """The engine thread fails before its loop (here: selecting the engine's GPU): a request gets
    EngineDeadError naming the cause, not a stream that never answers (as it did on a GPU, once)."""
    engine = LLM(tiny_qwen3, num_kvcache_blocks=8, kvcache_block_size=4, max_model_len=64)
    config = engine.config
    engine.config = copy.copy(config)
    engine.config.device = "cuda"  # (set after validation: this machine may have no GPU)

    def no_gpu(device):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(torch.cuda, "set_device", no_gpu)
    llm = AsyncLLM(engine)
    try:
        with pytest.raises(EngineDeadError, match="no GPU here"):
            run_first_output(llm, [1, 2, 3])
        assert not llm.is_running
    finally:
        engine.config = config
        llm.shutdown()


def test_an_engine_that_fails_on_a_request_fails_its_stream(tiny_qwen3):
    """add_request fails with an engine error (not a bad request): that request's stream hears why, the
    engine thread stops, and a later request is refused at once."""
    engine = LLM(tiny_qwen3, num_kvcache_blocks=8, kvcache_block_size=4, max_model_len=64)

    def broken(request_id, prompt, params=None):
        raise RuntimeError("the scheduler broke")

    engine.add_request = broken
    llm = AsyncLLM(engine)
    try:
        with pytest.raises(EngineDeadError, match="the scheduler broke"):
            run_first_output(llm, [1, 2, 3])
        llm.thread.join(10)
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            run_first_output(llm, [4, 5])
    finally:
        del engine.add_request
        llm.shutdown()


# --- the output collector: a slow consumer gets merged DELTA outputs ---------------------------------------------


def test_output_collector_merges_deltas_a_slow_consumer_has_not_taken():
    from minivllm.frontend.outputs import CompletionOutput, RequestOutput
    from minivllm.sampling_params import RequestOutputKind
    from minivllm.serve.output_collector import RequestOutputCollector

    def out(i: int, finish: str | None = None) -> RequestOutput:
        completions = [CompletionOutput(c, f"{c}:{i} ", [10 * c + i], None, None, finish) for c in (0, 1)]
        return RequestOutput("r", None, [1, 2], completions, finish is not None)

    async def main():
        delta = RequestOutputCollector(RequestOutputKind.DELTA)
        for i in range(3):
            delta.put_nowait(out(i, "length" if i == 2 else None))
        merged = await delta.get()
        assert [c.text for c in merged.outputs] == ["0:0 0:1 0:2 ", "1:0 1:1 1:2 "]
        assert [c.token_ids for c in merged.outputs] == [[0, 1, 2], [10, 11, 12]]
        assert merged.finished and [c.finish_reason for c in merged.outputs] == ["length", "length"]
        delta.put_nowait(out(3))
        assert (await delta.get()).outputs[0].token_ids == [3]  # taken in time: one step's output alone
        cumulative = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
        cumulative.put_nowait(out(0))
        cumulative.put_nowait(out(1))
        assert (await cumulative.get()).outputs[0].token_ids == [1]  # the latest holds everything
        delta.put_nowait(out(4))
        delta.put_nowait(RuntimeError("dead"))
        delta.put_nowait(out(5))  # nothing after an error
        assert isinstance(await delta.get(), RuntimeError)

    asyncio.run(main())
