"""The engine emits token ids, the front end makes text (minivllm/engine/llm_engine.py, engine/request.py,
frontend/output_processor.py, frontend/detokenizer.py): an engine without a front end reports EngineOutputs
(token ids, finish reasons, no text) that match what LLM.generate returns; the one OutputProcessor turns
EngineOutputs into RequestOutputs (n > 1 merged, DELTA pieces that join to the CUMULATIVE text, a stop string
reported back for the engine to end the sequence); the DecodeStream detokeniser gives exactly
`tokenizer.decode`, a character split over the last tokens included."""

import random

import pytest

from helpers.tiny_model import make_tokenizer
from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.request import EngineOutput
from minivllm.frontend.detokenizer import Detokenizer
from minivllm.frontend.output_processor import OutputProcessor
from minivllm.frontend.requests import Request
from minivllm.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer(512)


def test_the_engine_emits_token_ids_and_llm_gets_the_same(tiny_qwen3):
    engine = LLMEngine(tiny_qwen3, num_kvcache_blocks=16, kvcache_block_size=4, max_model_len=64)
    try:
        assert engine.sampling_hook is None  # no front end: temperatures only, nano-vllm's sampler
        engine.add_request("a", [1, 2, 3, 4, 5], GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("a", [1, 2], GREEDY)
        got, reasons = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert isinstance(out, EngineOutput) and (out.request_id, out.index) == ("a", 0)
                assert not hasattr(out, "text")
                got += out.new_token_ids
                reasons.append(out.finish_reason)
        assert reasons == [None] * 5 + ["length"]
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == len(bm.blocks) and not engine.requests
    finally:
        engine.exit()
    llm = LLM(tiny_qwen3, num_kvcache_blocks=16, kvcache_block_size=4, max_model_len=64)
    try:
        assert llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], GREEDY, use_tqdm=False)[0].token_ids == got
        llm.add_request("s", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=20))
        llm.step()
        llm.step()
        seq = llm.requests["s"].seqs[0]
        llm.finish_sequences([("s", 0)])  # what LLM.step does for a stop string: blocks freed at once
        assert seq.is_finished and not seq.block_table and "s" not in llm.requests
        while llm.has_unfinished_requests():
            llm.step()
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == len(bm.blocks)
    finally:
        llm.exit()


def request(rid: str, params: SamplingParams) -> Request:
    return Request(request_id=rid, prompt=None, prompt_token_ids=[1, 2, 3], params=params)


def test_one_output_processor_merges_n_and_streams_deltas(tokenizer):
    ids = tokenizer.encode("Hello world, hello again and again", add_special_tokens=False)
    texts = {}
    for kind in RequestOutputKind:
        op = OutputProcessor(tokenizer)
        op.add_request(request("r", SamplingParams(n=2, max_tokens=len(ids), output_kind=kind)))
        outputs = []
        for i, token in enumerate(ids):
            finish = "length" if i == len(ids) - 1 else None
            step = [EngineOutput("r", 0, [token], finish), EngineOutput("r", 1, [token], finish)]
            got, stopped = op.process(step)
            assert stopped == []
            outputs += got
        assert outputs[-1].finished and not op.requests
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outputs) == 1
        pieces = {0: "", 1: ""}
        for o in outputs:
            for c in o.outputs:
                pieces[c.index] = pieces[c.index] + c.text if kind == RequestOutputKind.DELTA else c.text
        texts[kind] = pieces
        assert [c.index for c in outputs[-1].outputs] == [0, 1] or kind == RequestOutputKind.DELTA
    want = tokenizer.decode(ids)
    assert all(t == {0: want, 1: want} for t in texts.values()), texts


def test_a_stop_string_is_reported_back_and_cut(tokenizer):
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    op = OutputProcessor(tokenizer)
    op.add_request(request("r", SamplingParams(max_tokens=50, stop=["three"])))
    stopped, final = [], None
    for token in ids:
        outputs, stop = op.process([EngineOutput("r", 0, [token])])
        stopped += stop
        final = outputs[-1] if outputs else final
        if stop:
            break
    assert stopped == [("r", 0)]  # the engine must end it
    c = final.outputs[0]
    assert final.finished and c.text == "one two " and c.finish_reason == "stop" and c.stop_reason == "three"
    assert op.process([EngineOutput("r", 0, [ids[-1]])]) == ([], [])  # a token that was in flight: dropped


def test_the_eos_token_has_no_text_and_an_abort_ends_the_stream(tokenizer):
    eos = tokenizer.eos_token_id
    op = OutputProcessor(tokenizer)
    op.add_request(request("r", SamplingParams(max_tokens=9, output_kind=RequestOutputKind.CUMULATIVE)))
    op.add_request(request("q", SamplingParams(max_tokens=9, output_kind=RequestOutputKind.DELTA)))
    hi = tokenizer.encode("hi", add_special_tokens=False)
    (out,), _ = op.process([EngineOutput("r", 0, hi + [eos], "stop")])
    assert out.outputs[0].text == "hi" and out.outputs[0].token_ids == hi + [eos]
    (out,), _ = op.process([EngineOutput("q", 0, [], "abort")])
    assert out.finished and out.outputs[0].finish_reason == "abort" and not op.requests


def test_prompt_logprobs_arrive_chunk_by_chunk_and_the_first_scores_are_kept(tokenizer):
    """The engine emits each prefill chunk's prompt rows in an output with no token; the front end gathers them,
    skips rows a recompute scores again, and hands them out with the first token."""
    op = OutputProcessor(tokenizer)
    prompt = [7, 8, 9, 10, 11]
    op.add_request(Request("r", None, prompt, SamplingParams(max_tokens=5, prompt_logprobs=0)))

    def row(logprob: float) -> tuple:  # (top ids, top logprobs, the token's logprob, its rank)
        return [], [], logprob, 1

    assert op.process([EngineOutput("r", 0, [], prompt_logprobs=(1, [row(-1.0), row(-2.0)]))]) == ([], [])
    assert op.process([EngineOutput("r", 0, [], prompt_logprobs=(1, [row(-9.0), row(-9.0)]))]) == ([], [])  # again
    chunk = EngineOutput("r", 0, [], prompt_logprobs=(2, [row(-9.0), row(-3.0), row(-4.0)]))  # overlaps by one
    (out,), _ = op.process([chunk, EngineOutput("r", 0, [5])])
    got = [None if e is None else e[t].logprob for e, t in zip(out.prompt_logprobs, prompt)]
    assert got == [None, -1.0, -2.0, -3.0, -4.0] and out.outputs[0].token_ids == [5]
    late = EngineOutput("r", 0, [], prompt_logprobs=(1, [row(-9.0)] * 4))  # a recompute after the first token
    (out,), _ = op.process([late, EngineOutput("r", 0, [6])])
    assert [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])] == [-1.0, -2.0, -3.0, -4.0]
    assert out.outputs[0].token_ids == [5, 6]


def test_decode_stream_text_is_exactly_decode(tokenizer):
    """Random token ids (many of them bytes of a character split over tokens): piece by piece, the text ends equal
    to tokenizer.decode, the incomplete last character included (a stream alone would drop it)."""
    rng = random.Random(0)
    emoji = tokenizer.encode("🙂 naïve 日本", add_special_tokens=False)
    for trial in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 30))]
        if trial % 2:
            ids = emoji[: rng.randrange(1, len(emoji) + 1)]
        for skip in (True, False):
            detok = Detokenizer(tokenizer, SamplingParams(skip_special_tokens=skip))
            for i, token in enumerate(ids):
                detok.add([token], final=i == len(ids) - 1)
            assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_the_core_imports_no_front_end():
    """The core (engine/, layers/, models/, utils/, config, sampling_params, checkpoint) never imports the front end
    or the server, directly or through another core module: they reach it from outside (the sampling hook, the
    output processor). (What kernels/ imports is the kernels' own rule: the walk does not enter it.)"""
    from test_imports import MODULES, imports_of

    core = [
        m
        for m in MODULES
        if m.split(".")[1:2] in (["engine"], ["layers"], ["models"], ["utils"])
        or m in ("minivllm.config", "minivllm.sampling_params", "minivllm.checkpoint")
    ]
    graph = {name: imports_of(name) for name in MODULES}
    for name in core:
        seen, todo = set(), [name]
        while todo:  # every module `name` reaches
            for m in graph[todo.pop()] - seen:
                seen.add(m)
                todo += [] if m.startswith("minivllm.kernels") else [m]
        extras = sorted(m for m in seen if m.startswith(("minivllm.frontend", "minivllm.serve")))
        assert not extras, f"{name} reaches {extras}"
