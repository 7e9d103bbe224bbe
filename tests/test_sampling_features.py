"""vLLM's sampling features through the engine (minivllm/sampling_params.py, engine/sampling_inputs.py,
layers/penalties.py, layers/logprobs.py, engine/detokenizer.py), each checked against a reference computed
here from transformers' logits of the same tiny model: penalties, min_tokens, logprobs, per-request seeds,
stop strings across token boundaries, n sequences sharing the prompt's blocks; and that a plain batch keeps
the decode graph's sampler while a batch that needs more samples outside it."""

from collections import Counter
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm import LLM, SamplingParams
from minivllm.engine.sequence import Sequence
from minivllm.frontend.sampling_checks import check_sampling_params
from minivllm.frontend.sampling_inputs import needs_processing, prepare_sampling
from minivllm.sampling_params import RequestOutputKind

ARGS = dict(kvcache_block_size=16, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=256)
_gen = torch.Generator().manual_seed(7)
P = [torch.randint(1, 512, (n,), generator=_gen).tolist() for n in (9, 14, 21, 40)]  # prompts
N = 10


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    engine = LLM(tiny_qwen3, num_kvcache_blocks=64, **ARGS)
    yield engine
    engine.exit()


@pytest.fixture(scope="module")
def logits_of(tiny_qwen3):
    """ids -> transformers' float64 logits (V,) of the next token."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].double()

    return logits


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{**dict(temperature=0, max_tokens=N, ignore_eos=True), **kw})


def reference_greedy(logits_of, prompt: list[int], n: int, process) -> list[int]:
    """n greedy tokens where `process(logits, output_so_far)` changes each step's logits first."""
    out = []
    for _ in range(n):
        out.append(int(process(logits_of(prompt + out), out).argmax()))
    return out


# --- penalties ------------------------------------------------------------------------------------------


def penalised(logits: torch.Tensor, prompt: list[int], output: list[int], rep=1.0, pres=0.0, freq=0.0):
    """vLLM's penalties, one token at a time: repetition over prompt and output, presence and frequency over
    the output."""
    logits = logits.clone()
    for t in set(prompt) | set(output):
        logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
    for t, c in Counter(output).items():
        logits[t] -= freq * c + pres
    return logits


PENALTIES = [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6),
    dict(presence_penalty=1.5),
    dict(presence_penalty=-2.0),  # boosts the output's tokens, not the prompt's
    dict(frequency_penalty=1.2),
    dict(frequency_penalty=-1.5),
    dict(repetition_penalty=1.3, presence_penalty=-0.5, frequency_penalty=0.7),
]


def test_penalties_match_a_reference_from_the_logits(llm, logits_of):
    """Penalised rows share the batch with plain rows; greedy tokens equal argmax of the reference penalties
    applied to transformers' logits, and differ from plain greedy (the penalties act)."""
    prompt = P[2]  # its greedy output repeats tokens
    params = [greedy(**kw) for kw in PENALTIES] + [greedy(), greedy()]
    outs = llm.generate([prompt] * len(PENALTIES) + [prompt, P[1]], params, use_tqdm=False)
    plain = reference_greedy(logits_of, prompt, N, lambda l, o: l)
    assert outs[len(PENALTIES)].token_ids == plain
    names = dict(repetition_penalty="rep", presence_penalty="pres", frequency_penalty="freq")
    for kw, out in zip(PENALTIES, outs):
        args = {names[k]: v for k, v in kw.items()}
        expected = reference_greedy(logits_of, prompt, N, lambda l, o: penalised(l, prompt, o, **args))
        assert out.token_ids == expected, kw
        assert expected != plain, f"{kw} changed nothing: not a test"
    assert llm.scheduler.block_manager.num_free_blocks == 64


def test_penalised_request_waits_for_its_newest_token(llm):
    """The engine runs one step ahead, but a step with penalties needs the newest token on the host: the
    step in flight is finished first (else prepare_sampling's PENDING check fires)."""
    launches = []
    original = llm.model_runner.launch

    def spy(seqs, is_prefill, hook):
        launches.append((llm.in_flight is not None, [s.request_id for s in seqs]))
        return original(seqs, is_prefill, hook)

    llm.model_runner.launch = spy
    try:
        llm.add_request("pen", P[2], greedy(repetition_penalty=1.5, max_tokens=4))
        while llm.has_unfinished_requests():
            llm.step()
        llm.add_request("plain", P[2], greedy(max_tokens=4))
        while llm.has_unfinished_requests():
            llm.step()
    finally:
        llm.model_runner.launch = original
    assert all(not overlapped for overlapped, ids in launches if "pen" in ids)
    assert any(overlapped for overlapped, ids in launches if "plain" in ids)  # the plain one keeps the overlap


# --- min_tokens -------------------------------------------------------------------------------------------


def test_min_tokens_masks_stop_tokens_until_reached(llm, logits_of):
    prompt = P[1]
    plain = reference_greedy(logits_of, prompt, N, lambda l, o: l)
    stop = plain[2]  # greedy would stop at its 3rd token
    early = llm.generate(prompt, greedy(stop_token_ids=[stop]), use_tqdm=False)[0]
    assert early.token_ids == plain[:3] and early.finish_reason == "stop"
    assert early.outputs[0].stop_reason == stop
    banned = [stop, *llm.eos]

    def mask(logits, out):
        if len(out) < 6:
            logits = logits.clone()
            logits[banned] = float("-inf")
        return logits

    expected = reference_greedy(logits_of, prompt, N, mask)
    if stop in expected:  # after min_tokens the stop token ends it again
        expected = expected[: expected.index(stop) + 1]
    out = llm.generate(prompt, greedy(stop_token_ids=[stop], min_tokens=6), use_tqdm=False)[0]
    assert out.token_ids == expected
    assert len(out.token_ids) >= 6 and stop not in out.token_ids[:6]


# --- logprobs -----------------------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits_with_ranks(llm, logits_of):
    """Sampled at temperature 0.7 with a repetition penalty: the logprobs still describe the raw model
    (log_softmax of its logits), the sampled token first, then the top 3 with ranks 1..3."""
    tokenizer = llm.get_tokenizer()
    sp = SamplingParams(temperature=0.7, repetition_penalty=1.5, seed=3, max_tokens=6, ignore_eos=True, logprobs=3)
    out = llm.generate(P[2], sp, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    total = 0.0
    for i, (token, step) in enumerate(zip(out.token_ids, out.logprobs)):
        lp = logits_of(P[2] + out.token_ids[:i]).log_softmax(-1)
        assert next(iter(step)) == token  # the sampled token first
        assert step[token].logprob == pytest.approx(lp[token].item(), abs=1e-4)
        assert step[token].rank == int((lp >= lp[token] - 1e-9).sum())
        assert step[token].decoded_token == tokenizer.decode([token])
        top = lp.topk(3)
        ranked = sorted((e.rank, t, e.logprob) for t, e in step.items() if t in top.indices.tolist())
        assert [t for _, t, _ in ranked] == top.indices.tolist() and [r for r, _, _ in ranked][:3] == [1, 2, 3]
        assert [v for _, _, v in ranked] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert len(step) == 3 + (token not in top.indices.tolist())
        total += lp[token].item()
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)
    no_lp = llm.generate(P[2], replace(sp, logprobs=None), use_tqdm=False)[0].outputs[0]
    assert no_lp.logprobs is None and no_lp.cumulative_logprob is None
    assert no_lp.token_ids == out.token_ids  # asking for logprobs does not change the draw
    zero = llm.generate(P[2], replace(sp, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert [list(s) for s in zero.logprobs] == [[t] for t in out.token_ids]


# --- seeds ----------------------------------------------------------------------------------------------------


def reference_seeded(logits_of, prompt: list[int], n: int, seed: int, temperature: float, device) -> list[int]:
    """The race argmax(p / E) with E drawn from a generator seeded with `seed`, one row per step. The generator
    lives on the engine's device: CPU and CUDA generators draw different streams from one seed."""
    gen, out = torch.Generator(device=device).manual_seed(seed), []
    for _ in range(n):
        p = torch.softmax(logits_of(prompt + out).float() / temperature, -1).to(device)
        e = torch.empty_like(p).exponential_(1, generator=gen).clamp_min_(1e-10)
        out.append(int((p / e).argmax()))
    return out


def test_seeded_request_is_reproducible_whatever_the_batch(llm, tiny_qwen3, logits_of):
    sp = SamplingParams(temperature=0.9, seed=11, max_tokens=8, ignore_eos=True)
    alone = llm.generate(P[0], sp, use_tqdm=False)[0].token_ids
    assert alone == reference_seeded(logits_of, P[0], 8, 11, 0.9, llm.model_runner.device)
    others = [SamplingParams(temperature=1.0, max_tokens=8), replace(sp, seed=12), greedy(max_tokens=3)]
    mixed = llm.generate([P[1], P[0], P[0], P[2]], [others[0], sp, others[1], others[2]], use_tqdm=False)
    assert mixed[1].token_ids == alone
    assert mixed[2].token_ids != alone  # another seed, another draw
    second = LLM(tiny_qwen3, num_kvcache_blocks=64, seed=1234, **ARGS)  # another engine seed: no matter
    assert second.generate([P[3], P[0]], [others[0], sp], use_tqdm=False)[1].token_ids == alone
    second.exit()


def test_n_sequences_share_the_prompt_blocks_and_use_seed_plus_i(llm):
    bm = llm.scheduler.block_manager
    prompt = P[3]  # 40 tokens: 2 full blocks of 16 to share
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    llm.reset_prefix_cache()
    hits = bm.num_prefix_hits
    out = llm.generate(prompt, sp, use_tqdm=False)[0]
    assert bm.num_prefix_hits - hits == 2 * 2  # sequences 1 and 2 found the 2 blocks sequence 0 computed
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = [llm.generate(prompt, replace(sp, n=1, seed=5 + i), use_tqdm=False)[0].token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == singles
    assert len({tuple(s) for s in singles}) == 3
    assert bm.num_free_blocks == len(bm.blocks)


# --- stop strings ---------------------------------------------------------------------------------------------


def boundary_stop(tokenizer, tokens: list[int]) -> tuple[str, int]:
    """A 2-character stop string whose first character ends token k and whose second starts token k + 1
    (printable characters, its first occurrence in the text), and k."""
    text = tokenizer.decode(tokens)
    for k in range(len(tokens) - 1):
        a, b = tokenizer.decode(tokens[: k + 1]), tokenizer.decode(tokens[: k + 2])
        if not (a and len(b) > len(a) and b.startswith(a) and text.startswith(b)):
            continue
        stop = a[-1] + b[len(a)]
        if stop.isprintable() and "\ufffd" not in stop and text.find(stop) == len(a) - 1:
            return stop, k
    raise AssertionError(f"no clean token boundary in {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_a_token_boundary(llm, include):
    tokenizer = AutoTokenizer.from_pretrained(llm.config.model)
    full = llm.generate("The quick brown fox", greedy(max_tokens=16), use_tqdm=False)[0]
    stop, k = boundary_stop(tokenizer, full.token_ids)
    at = full.text.find(stop)
    sp = greedy(max_tokens=16, stop=["zzzz", stop], include_stop_str_in_output=include)
    out = llm.generate("The quick brown fox", sp, use_tqdm=False)[0]
    assert out.text == full.text[: at + (len(stop) if include else 0)]
    assert out.token_ids == full.token_ids[: k + 2]  # up to the token that completed the stop string
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    # streamed (DELTA through the step API): what is shown is never cut later, and adds up to the text
    llm.add_request("s", "The quick brown fox", replace(sp, output_kind=RequestOutputKind.DELTA))
    shown = ""
    while llm.has_unfinished_requests():
        for o in llm.step():
            shown += o.outputs[0].text
            assert out.text.startswith(shown), f"{shown!r} was shown, then cut"
    assert shown == out.text


# --- validation ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be an integer >= 1"),
        (dict(n=2, temperature=0), "n must be 1 when sampling greedily"),
        (dict(logprobs=21), r"logprobs must be an integer in \[0, 20\]"),
        (dict(logprobs=-1), "logprobs must be"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]"),
        (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens must be <= max_tokens 4"),
        (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
        (dict(stop=["ok", ""]), "stop must be a string or a list of non-empty strings"),
        (dict(stop_token_ids=[1.5]), "stop_token_ids must be a list of integers"),
        (dict(seed="7"), "seed must be an integer or None"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(top_k=-2), "top_k must be an integer >= 0"),
        (dict(temperature=float("nan")), "temperature must be >= 0"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):  # checked where a request is accepted (the Processor)
        check_sampling_params(SamplingParams(**kwargs))


def test_vllm_defaults_and_normalisation():
    sp = SamplingParams()
    assert (sp.n, sp.max_tokens, sp.temperature, sp.top_k, sp.logprobs, sp.stop, sp.stop_token_ids) == (
        1,
        16,
        1.0,
        0,
        None,
        [],
        [],
    )
    assert SamplingParams(stop="x").stop == ["x"]
    minus_one = SamplingParams(top_k=-1)
    check_sampling_params(minus_one)  # vLLM's other spellings are normalised where a request is accepted
    assert minus_one.top_k == 0
    g = SamplingParams(temperature=0, top_k=5, top_p=0.5)
    check_sampling_params(g)  # greedy: the filters are off
    assert (g.top_k, g.top_p) == (0, 1.0) and not needs_processing(g)
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_engine_checks_stop_token_ids_and_resolves_max_tokens_none(llm):
    with pytest.raises(ValueError, match=r"stop_token_ids \[512\] are outside the vocabulary"):
        llm.generate(P[0], greedy(stop_token_ids=[512]), use_tqdm=False)
    out = llm.generate(P[0], greedy(max_tokens=None), use_tqdm=False)[0]
    assert len(out.token_ids) == 128 - len(P[0]) and out.finish_reason == "length"
    with pytest.raises(ValueError, match="leaves no room for output within max_model_len 128"):
        llm.generate(list(range(1, 129)), greedy(max_tokens=None), use_tqdm=False)


# --- the fast path: plain batches sample inside the decode graph ------------------------------------------------


def test_only_rows_that_need_more_leave_the_graph_sampler(llm):
    runner = llm.model_runner
    seqs = lambda *sps: [scheduled(Sequence([1, 2, 3], sp)) for sp in sps]
    prep = lambda ss, in_graph=True: prepare_sampling(
        ss, runner.buffers, device=runner.device, eos=llm.eos, vocab=llm.vocab_size, in_graph=in_graph
    )
    hot = SamplingParams(temperature=0.8)
    assert prep(seqs(hot, greedy())) is None  # temperatures only: no extras, the core samples (nano-vllm's path)
    assert runner.prepare_sample(seqs(hot, greedy()), in_graph=False) is not None
    assert runner.prepare_sample(seqs(greedy(), greedy()), in_graph=False) is None  # all greedy, eager: argmax
    assert runner.prepare_sample(seqs(greedy(), greedy()), in_graph=True) is not None  # the graph reads them
    for kw in (
        dict(top_k=5),
        dict(top_p=0.9),
        dict(min_p=0.1),
        dict(seed=1),
        dict(logprobs=0),
        dict(repetition_penalty=1.1),
        dict(presence_penalty=0.5),
        dict(min_tokens=2, max_tokens=4),
    ):
        assert not prep(seqs(hot, replace(hot, **kw))).plain, kw
    done = Sequence([1, 2, 3], replace(hot, min_tokens=1))
    done.append_token(4)  # min_tokens reached: plain again
    assert prep([scheduled(done)]) is None


def scheduled(seq: Sequence) -> Sequence:
    """`seq` as a step that computes all its tokens schedules it (so the step samples its next token)."""
    seq.num_scheduled_tokens = seq.num_tokens
    return seq


@pytest.mark.gpu
def test_gpu_plain_batches_keep_the_graph_sampler(tiny_qwen3, monkeypatch):
    """With CUDA graphs, decode steps of plain batches never call the eager sampling path; a penalised row
    does; the penalised tokens equal an eager engine's."""
    from minivllm.layers.sampler import Sampler

    kw = dict(device="cuda", dtype="float32", num_kvcache_blocks=64, seed=5, **ARGS)
    graphed = LLM(tiny_qwen3, **kw)
    calls = []
    original = Sampler.forward  # the eager draw (a graph's replay runs no Python: patched after the capture)
    monkeypatch.setattr(Sampler, "forward", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    graphed.generate(P, SamplingParams(temperature=0.8, max_tokens=N, ignore_eos=True), use_tqdm=False)
    assert len(calls) == 1  # the prefill step only
    pen = greedy(repetition_penalty=1.5)
    out_graph = [o.token_ids for o in graphed.generate(P, pen, use_tqdm=False)]
    assert len(calls) > N
    graphed.exit()
    eager = LLM(tiny_qwen3, enforce_eager=True, **kw)
    assert [o.token_ids for o in eager.generate(P, pen, use_tqdm=False)] == out_graph
    eager.exit()
