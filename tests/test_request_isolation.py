"""One request cannot break the engine (issue 42), offline: a seed beyond int64 or an `n` beyond vLLM's limit is a
ValueError at add time and leaves the LLM usable; a top_k at or above the vocabulary is no limit (vLLM's meaning); a
request whose own step inputs fail to prepare ends alone with finish_reason "error" while the others finish with
their usual tokens, leaving nothing queued and no KV block held; a failure no request alone causes still stops the
engine; and a grammar compiles in a thread while the steps of the running requests go on."""

import threading
import time

import pytest

from helpers.poison import POISON, poison_generator_of
from minivllm import LLM, SamplingParams
from minivllm.frontend.sampling_checks import MAX_N
from minivllm.frontend.structured_outputs import StructuredOutputsParams
from minivllm.frontend.structured_outputs.grammar import GrammarCompiler
from minivllm.serve.core import EngineCore

ARGS = dict(kvcache_block_size=16, max_model_len=256, max_num_seqs=8, num_kvcache_blocks=32, enforce_eager=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    engine = LLM(tiny_qwen3, **ARGS)
    yield engine
    engine.exit()


def idle(llm: LLM) -> bool:
    bm = llm.scheduler.block_manager
    return not llm.requests and llm.scheduler.is_finished() and bm.num_free_blocks == len(bm.blocks)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(seed=2**64), "seed must be an integer or None, within int64"),
        (dict(seed=10**30), "seed must be an integer or None, within int64"),
        (dict(seed=-(2**63) - 1), "seed must be an integer or None, within int64"),
        (dict(seed=2**63 - 1, n=2), "seed must be an integer or None, within int64"),  # child 1 draws from seed + 1
        (dict(n=10**6), f"n must be an integer >= 1 and <= {MAX_N}"),
        (dict(n=MAX_N + 1), f"n must be an integer >= 1 and <= {MAX_N}"),
    ],
)
def test_out_of_range_fields_are_refused_at_add_time_and_the_llm_goes_on(llm, fields, message):
    t = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, **fields), use_tqdm=False)
    assert time.perf_counter() - t < 1  # refused before anything is built for n = 10**6
    assert idle(llm)
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, seed=1), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and idle(llm)


def test_int64_edge_seeds_run(llm):
    for seed in (2**63 - 1, -(2**63)):
        (out,) = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=3, seed=seed, ignore_eos=True), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("top_k", [512, 2**63, 10**30])
def test_top_k_at_or_above_the_vocabulary_is_no_limit(llm, top_k):
    sp = dict(max_tokens=6, seed=3, temperature=1.0, ignore_eos=True)
    (ref,) = llm.generate([PROMPTS[2]], SamplingParams(**sp), use_tqdm=False)
    (out,) = llm.generate([PROMPTS[2]], SamplingParams(top_k=top_k, **sp), use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert idle(llm)


def test_a_request_whose_sampling_fails_ends_alone(llm, monkeypatch):
    params = [SamplingParams(max_tokens=5, seed=s, ignore_eos=True) for s in (1, POISON, 2)]
    ref = llm.generate(PROMPTS, params, use_tqdm=False)
    assert ref[1].outputs[0].finish_reason == "length"  # unpatched, the poisoned seed is a seed like any other
    poison_generator_of(monkeypatch)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert got[1].finished and got[1].outputs[0].finish_reason == "error"
    assert "cannot seed this one" in got[1].outputs[0].stop_reason
    for i in (0, 2):
        assert got[i].outputs[0].token_ids == ref[i].outputs[0].token_ids
    assert idle(llm)
    # n > 1: the whole request fails, its sibling sequences too; the LLM goes on
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=4, seed=POISON - 1), use_tqdm=False)
    assert [c.finish_reason for c in out.outputs] == ["error", "error"]
    assert idle(llm)
    (ok,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, seed=1, ignore_eos=True), use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 4 and idle(llm)


def test_a_failure_no_request_causes_stops_the_step(tiny_qwen3, monkeypatch):
    """Every sequence prepares alone, so the model itself failed: the engine raises (the server's core dies, and
    its API server exits for a supervisor), and no request is wrongly blamed."""
    engine = LLM(tiny_qwen3, **ARGS)
    try:

        def broken(*args, **kwargs):
            raise RuntimeError("the device is gone")

        monkeypatch.setattr(engine.model_runner, "run_model", broken)
        with pytest.raises(RuntimeError, match="the device is gone"):
            engine.generate(PROMPTS, SamplingParams(max_tokens=3), use_tqdm=False)
    finally:
        engine.exit()


def test_a_grammar_compiles_off_the_step_loop(llm, monkeypatch):
    """A request whose grammar compiles for as long as the engine takes 12 steps waits for it in a thread of the
    pool; meanwhile every step of the running request stays short and the running request keeps getting tokens;
    then the grammar request runs and its output is in its language."""
    real, threads, release = GrammarCompiler.compile, [], threading.Event()

    def slow_compile(self, params):
        threads.append(threading.current_thread())
        assert release.wait(timeout=60)  # a heavy grammar: its compile ends once the test has seen 12 steps
        return real(self, params)

    monkeypatch.setattr(GrammarCompiler, "compile", slow_compile)
    llm.add_request("running", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=200, ignore_eos=True))
    llm.step()
    running = llm.requests["running"].seqs[0]
    choice = StructuredOutputsParams(choice=["yes", "no"])
    llm.add_request("grammar", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(structured_outputs=choice))
    assert EngineCore(llm).stats().num_waiting == 1  # the server's gauges count it as waiting (vLLM's)
    steps, tokens_before, outputs = [], running.num_completion_tokens, {}
    while llm.sampling_hook.num_waiting:
        t = time.perf_counter()
        outputs.update({o.request_id: o for o in llm.step()})
        steps.append(time.perf_counter() - t)
        if len(steps) == 12:
            release.set()
        assert running.num_completion_tokens < 200, "the running request finished before the compile did"
    assert threads and threads[0] is not threading.current_thread()
    assert len(steps) > 10 and max(steps) < 0.5, (len(steps), max(steps))
    assert running.num_completion_tokens - tokens_before > 10  # it kept its pace meanwhile
    llm.abort_request("running")
    while llm.has_unfinished_requests():
        outputs.update({o.request_id: o for o in llm.step()})
    assert outputs["grammar"].finished and outputs["grammar"].outputs[0].text in ("yes", "no")
    assert idle(llm)


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(llm):
    choice = StructuredOutputsParams(regex="[a-z]{3,9}")
    llm.add_request("gone", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(structured_outputs=choice))
    llm.abort_request("gone")
    while llm.has_unfinished_requests() or llm.sampling_hook.num_waiting:
        assert llm.step() == []
    assert idle(llm)
