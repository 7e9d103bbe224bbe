"""The offline API as a vLLM user calls it (minivllm/llm.py, inputs.py, outputs.py) and the engine's step API
(engine/llm_engine.py): prompt forms (text, token ids, numpy integers, vLLM's dicts) and clear errors for
others; LLM.chat through the chat template; get_tokenizer; reset_prefix_cache; the outputs' shape; and
add_request / step / abort_request: an abort frees the request's blocks at once wherever it is (waiting,
running, in the step in flight, preempted) and the other requests finish with their exact greedy tokens."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.engine.sequence import SequenceStatus
from minivllm.frontend.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind

ARGS = dict(kvcache_block_size=16, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=256)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
_gen = torch.Generator().manual_seed(3)
PROMPTS = [torch.randint(1, 512, (n,), generator=_gen).tolist() for n in (5, 12, 19, 26)]


@pytest.fixture(scope="module")
def llm(chat_model):
    engine = LLM(chat_model, num_kvcache_blocks=64, **ARGS)
    yield engine
    engine.exit()


@pytest.fixture(scope="module")
def hf(chat_model):
    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()

    def greedy(ids: list[int], n: int = 6) -> list[int]:  # argmax n times, EOS or not (ignore_eos)
        out = []
        with torch.no_grad():
            for _ in range(n):
                out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
        return out

    return greedy


# --- prompts -----------------------------------------------------------------------------------------------


def test_every_prompt_form_gives_the_same_tokens(llm, hf):
    ids = PROMPTS[1]
    text = llm.get_tokenizer().decode(ids)
    forms = [
        ids,
        np.array(ids, dtype=np.int64),
        [np.int32(t) for t in ids],
        {"prompt_token_ids": ids},
        {"prompt_token_ids": np.array(ids)},
    ]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert all(o.token_ids == hf(ids) and o.prompt_token_ids == ids and o.prompt is None for o in outs)
    by_text = llm.generate([text, {"prompt": text}], GREEDY, use_tqdm=False)
    encoded = llm.tokenizer.encode(text)
    assert [o.prompt for o in by_text] == [text, text]
    assert all(o.prompt_token_ids == encoded and o.token_ids == hf(encoded) for o in by_text)
    single = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)  # one prompt, not in a list
    assert len(single) == 1 and single[0].token_ids == hf(ids)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt_token_ids": [1, 2], "prompt": "x"}, "exactly one key"),
        ({"text": "hi"}, r"exactly one key, 'prompt' or 'prompt_token_ids'; got keys \['text'\]"),
        ({"prompt": 5}, "'prompt' must be a string"),
        ({"prompt_token_ids": "1 2"}, "'prompt_token_ids' must be a list of integers"),
        ([1.0, 2.0], "a prompt must be a string, a list of token ids"),
        (None, "got NoneType"),
        ([1, "2"], "got a list of int/str"),
    ],
)
def test_bad_prompts_are_refused_with_the_whole_batch(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0], prompt], GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests()  # nothing of the batch was queued


# --- chat ----------------------------------------------------------------------------------------------------


def test_chat_applies_the_template(llm, hf):
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = "<|user|>What is the capital of France?\n<|assistant|>"
    (out,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt == rendered and out.prompt_token_ids == ids and out.token_ids == hf(ids)
    two = llm.chat([conversation, conversation + [{"role": "assistant", "content": "Paris"}]], GREEDY, use_tqdm=False)
    assert two[0].token_ids == out.token_ids and two[1].prompt.endswith("Paris\n<|assistant|>")
    with pytest.raises(ValueError, match="needs 'role' and 'content'"):
        llm.chat([{"content": "hi"}], GREEDY, use_tqdm=False)


def test_chat_without_a_template_is_refused(tiny_qwen3):
    llm = LLM(tiny_qwen3, num_kvcache_blocks=8, **ARGS)
    with pytest.raises(ValueError, match="has no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    llm.exit()


# --- outputs, prefix cache ---------------------------------------------------------------------------------------


def test_outputs_have_vllms_shape(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.8, n=2, seed=1, max_tokens=4), use_tqdm=False)[0]
    assert isinstance(out, RequestOutput) and isinstance(out.request_id, str) and out.finished
    assert len(out.outputs) == 2 and all(isinstance(c, CompletionOutput) for c in out.outputs)
    c = out.outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == (c.text, c.token_ids, c.finish_reason)
    assert c.finished() and c.cumulative_logprob is None and c.logprobs is None and c.stop_reason is None
    with pytest.raises(AttributeError):
        out.text = "x"  # a read-only shortcut


def test_reset_prefix_cache(llm):
    bm = llm.scheduler.block_manager
    prompt = PROMPTS[3] + PROMPTS[2]  # 45 tokens: 2 full blocks
    llm.generate(prompt, GREEDY, use_tqdm=False)
    hits = bm.num_prefix_hits
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert bm.num_prefix_hits == hits + 2
    assert llm.reset_prefix_cache()
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert bm.num_prefix_hits == hits + 2  # cold again
    llm.add_request("holding", prompt, GREEDY)
    llm.step()
    assert not llm.reset_prefix_cache()  # a running request holds blocks
    llm.abort_request("holding")
    assert llm.reset_prefix_cache()
    while llm.has_unfinished_requests():
        llm.step()


# --- the step API: outputs per step, aborts ---------------------------------------------------------------------


def test_step_outputs_cumulative_and_delta(llm, hf):
    llm.add_request("c", PROMPTS[0], GREEDY)
    llm.add_request("d", PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, output_kind=RequestOutputKind.DELTA))
    assert llm.get_num_unfinished_requests() == 2  # vLLM's step API
    seen = {"c": [], "d": []}
    while llm.has_unfinished_requests():
        for o in llm.step():
            seen[o.request_id].append((list(o.token_ids), o.finished))
    c, d = seen["c"], seen["d"]
    assert [len(t) for t, _ in c] == [1, 2, 3, 4, 5, 6] and c[-1] == (hf(PROMPTS[0]), True)
    assert [f for _, f in c] == [False] * 5 + [True]
    assert sum((t for t, _ in d), []) == hf(PROMPTS[1]) and all(len(t) == 1 for t, _ in d)
    assert llm.get_num_unfinished_requests() == 0
    with pytest.raises(ValueError, match="request id 'x' is already in use"):
        llm.add_request("x", PROMPTS[0], GREEDY)
        llm.add_request("x", PROMPTS[0], GREEDY)
    llm.abort_request("x")


def holders(llm) -> list:
    s = llm.scheduler
    return s.running + s.finishing


def check_blocks(llm) -> None:
    """Free + used = all; each block's reference count = the sequences holding it."""
    bm = llm.scheduler.block_manager
    held = [0] * len(bm.blocks)
    for seq in holders(llm):
        for b in seq.block_table:
            held[b] += 1
    assert [b.ref_count for b in bm.blocks] == held
    assert bm.num_free_blocks == sum(h == 0 for h in held)


def run_all(llm) -> dict:
    finished = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            assert o.request_id not in finished, f"{o.request_id} output after it finished"
            if o.finished:
                finished[o.request_id] = o.token_ids
        check_blocks(llm)
    return finished


def test_abort_frees_blocks_wherever_the_request_is(chat_model, hf):
    """max_num_seqs 2: c waits. a and b run; b is in the step in flight when aborted; c is aborted while
    waiting; the others finish with their greedy tokens; no aborted request ever outputs again."""
    llm = LLM(chat_model, num_kvcache_blocks=16, **{**ARGS, "max_num_seqs": 2})
    bm = llm.scheduler.block_manager
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for rid, p in zip("abcd", PROMPTS):
        llm.add_request(rid, p, sp)
    llm.step()
    llm.step()
    b = llm.requests["b"].seqs[0]
    assert llm.in_flight is not None and b in llm.in_flight.seqs and b.block_table
    free = bm.num_free_blocks
    llm.abort_request("b")
    assert bm.num_free_blocks == free + 1 and b.status == SequenceStatus.FINISHED and b.finish_reason == "abort"
    c = llm.requests["c"].seqs[0]
    assert c in llm.scheduler.waiting
    llm.abort_request(["c", "nonexistent"])
    assert c not in llm.scheduler.waiting
    check_blocks(llm)
    done = run_all(llm)
    assert done == {"a": hf(PROMPTS[0], 8), "d": hf(PROMPTS[3], 8)}
    assert bm.num_free_blocks == 16
    llm.exit()


def test_abort_a_preempted_request(chat_model, hf):
    llm = LLM(chat_model, num_kvcache_blocks=5, **ARGS)  # 16-token blocks: the 4 prompts outgrow 5 blocks
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for rid, p in zip("abcd", PROMPTS):
        llm.add_request(rid, p, sp)
    while llm.scheduler.num_preemptions == 0:
        llm.step()
    preempted = [
        r for r, q in llm.requests.items() if q.seqs[0] in llm.scheduler.waiting and q.seqs[0].output_token_ids
    ]
    assert preempted
    llm.abort_request(preempted[0])
    done = run_all(llm)
    expected = {r: hf(p, 20) for r, p in zip("abcd", PROMPTS) if r != preempted[0]}
    assert done == expected
    assert llm.scheduler.block_manager.num_free_blocks == 5
    llm.exit()
