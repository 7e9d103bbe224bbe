"""What vLLM users write, through the engine and the server, judged against vLLM's documented behaviour: a seeded
request's tokens whatever else is batched, the stop token's text kept out of `text`, prompt logprobs (against
transformers' log-softmax in fp32), `echo` scoring over HTTP, logit_bias / allowed_token_ids / bad_words,
`clone()`, `continue_final_message`, the `LLM(...)` arguments vLLM users pass, and vLLM's overflow wording."""

import time

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.frontend.sampling_checks import check_sampling_params

ARGS = dict(kvcache_block_size=16, max_model_len=256, max_num_seqs=8, num_kvcache_blocks=96)
_gen = torch.Generator().manual_seed(3)
LONG = torch.randint(1, 512, (161,), generator=_gen).tolist()
OTHER = torch.randint(1, 512, (150,), generator=_gen).tolist()


# --- seeded sampling: a prefill chunk that does not finish the prompt draws nothing ------------------------


@pytest.fixture(scope="module")
def chunked(tiny_qwen3):
    engine = LLM(tiny_qwen3, max_num_batched_tokens=200, enable_prefix_caching=False, **ARGS)  # chunks every time
    yield engine
    engine.exit()


def test_seeded_tokens_do_not_depend_on_the_batch(chunked):
    sp = SamplingParams(temperature=1.0, seed=77, max_tokens=8, ignore_eos=True)
    alone = chunked.generate([LONG], sp, use_tqdm=False)[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    queued = chunked.generate([OTHER, LONG], [other, sp], use_tqdm=False)[1].token_ids  # LONG prefilled in chunks
    assert queued == alone


def test_seeded_n2_sample_1_is_seed_plus_1_alone(chunked):
    sp = SamplingParams(temperature=1.0, seed=77, max_tokens=8, ignore_eos=True)
    two = chunked.generate([LONG], SamplingParams(n=2, **_fields(sp)), use_tqdm=False)[0]
    first = chunked.generate([LONG], sp, use_tqdm=False)[0].token_ids
    second = chunked.generate([LONG], SamplingParams(**{**_fields(sp), "seed": 78}), use_tqdm=False)[0].token_ids
    assert [c.token_ids for c in two.outputs] == [first, second]


def _fields(sp: SamplingParams) -> dict:
    return dict(temperature=sp.temperature, seed=sp.seed, max_tokens=sp.max_tokens, ignore_eos=sp.ignore_eos)


# --- the text of the token that ended the output --------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    engine = LLM(tiny_qwen3, max_num_batched_tokens=256, **ARGS)
    yield engine
    engine.exit()


@pytest.mark.parametrize("stop", [None, ["@@@@"]])  # decoded once at the end / token by token (a stop string)
@pytest.mark.parametrize("include", [False, True])
def test_the_eos_text_is_not_in_the_output(llm, stop, include):
    tok, eos = llm.get_tokenizer(), llm.eos[0]
    sp = SamplingParams(
        temperature=0, max_tokens=6, min_tokens=2, logit_bias={eos: 100.0}, skip_special_tokens=False,
        stop=stop, include_stop_str_in_output=include,
    )  # fmt: skip
    out = llm.generate([LONG[:20]], sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == eos and len(out.token_ids) == 3 and out.finish_reason == "stop"
    ids = out.token_ids if include else out.token_ids[:-1]
    assert out.text == tok.decode(ids, skip_special_tokens=False)
    assert out.text.endswith(tok.eos_token) == include


# --- prompt logprobs -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()


def reference_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax in fp32: row j scores token j + 1."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)[:-1]


def check_prompt_logprobs(got, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for j, entry in enumerate(got[1:]):
        token = prompt[j + 1]
        top = ref[j].topk(k).indices.tolist()
        assert list(entry)[0] == token and set(entry) == {token, *top}
        assert abs(entry[token].logprob - ref[j, token].item()) < 1e-4
        assert entry[token].rank == int((ref[j] >= ref[j, token]).sum())
        for r, t in enumerate(top, start=1):
            assert entry[t].rank == r and abs(entry[t].logprob - ref[j, t].item()) < 1e-4


def test_prompt_logprobs_match_transformers_across_chunks_and_prefix_hits(chunked, llm, hf_model, monkeypatch):
    monkeypatch.setattr("minivllm.frontend.prompt_logprobs.SLICE", 7)  # positions scored 7 at a time
    prompt = LONG[:120]
    ref = reference_prompt_logprobs(hf_model, prompt)
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    for engine in (chunked, llm, llm):  # chunks of a 200-token budget beside another prompt; then a prefix hit
        out = engine.generate([OTHER, prompt], [SamplingParams(max_tokens=2), sp], use_tqdm=False)
        assert out[0].prompt_logprobs is None
        check_prompt_logprobs(out[1].prompt_logprobs, prompt, ref, 3)
    zero = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert all(len(e) == 1 for e in zero.prompt_logprobs[1:])


# --- logit_bias, allowed_token_ids, bad_words ------------------------------------------------------------------


def reference_greedy(hf_model, prompt: list[int], n: int, process) -> list[int]:
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out])).logits[0, -1].double()
        out.append(int(process(logits, out).argmax()))
    return out


def test_logit_bias_and_allowed_token_ids(llm, hf_model):
    prompt = LONG[:30]
    bias = {17: 3.0, 250: -5.0, 400: 2.5}
    allowed = [3, 17, 99, 250, 400]

    def biased(logits, _):
        for t, b in bias.items():
            logits[t] += b
        return logits

    def restricted(logits, _):
        keep = torch.full_like(logits, float("-inf"))
        keep[allowed] = 0
        return biased(logits, _) + keep

    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(**greedy, logit_bias=bias),
            SamplingParams(**greedy, logit_bias=bias, allowed_token_ids=allowed),
            SamplingParams(**greedy, logit_bias={401: 100}),
        ],
        use_tqdm=False,
    )
    assert outs[0].token_ids == reference_greedy(hf_model, prompt, 8, biased)
    assert outs[1].token_ids == reference_greedy(hf_model, prompt, 8, restricted)
    assert outs[2].token_ids == [401] * 8


def test_bad_words_ban_the_last_token_after_the_others(llm, hf_model):
    """Outputs drawn from a word's two tokens only (allowed_token_ids): the word itself appears in the plain
    output, and with the word banned its second token never follows its first."""
    prompt = LONG[:30]
    greedy = dict(temperature=0, max_tokens=10, ignore_eos=True)
    for word in ("quick", "brown", "capital", "France", "inference", "scheduler", "prefix", "graphs", "engine"):
        words = llm.processor.bad_words_token_ids([word])
        w = words[0]
        if len(w) != 2:
            continue
        plain = llm.generate([prompt], SamplingParams(**greedy, allowed_token_ids=w), use_tqdm=False)[0].token_ids
        if any(plain[i : i + 2] == w for i in range(len(plain))):
            break
    else:
        pytest.fail("no two-token word of the corpus appears in a greedy output over its tokens")

    def banned(logits, out):
        keep = torch.full_like(logits, float("-inf"))
        keep[w] = 0
        logits = logits + keep
        for v in words:
            if len(v) == 1 or out[len(out) - len(v) + 1 :] == v[:-1]:
                logits[v[-1]] = float("-inf")
        return logits

    sp = SamplingParams(**greedy, allowed_token_ids=w, bad_words=[word])
    got = llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
    assert got == reference_greedy(hf_model, prompt, 10, banned)
    assert got != plain and not any(got[i : i + 2] == w for i in range(len(got)))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(logit_bias={5000: 1.0}), r"logit_bias token ids \[5000\] are outside the vocabulary"),
        (dict(allowed_token_ids=[1, 512]), r"allowed_token_ids \[512\] are outside the vocabulary"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(llm, kw, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3]], SamplingParams(**kw), use_tqdm=False)
    assert not llm.requests


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(logit_bias=[1, 2]), "logit_bias must be a dict"),
        (dict(logit_bias={1: float("nan")}), "logit_bias must be a dict"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
        (dict(allowed_token_ids=["a"]), "allowed_token_ids must be a list of integers"),
        (dict(bad_words=["ok", ""]), "bad_words must be a list of non-empty strings"),
        (dict(prompt_logprobs=21), r"prompt_logprobs must be an integer in \[0, 20\]"),
    ],
)
def test_bad_values_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):  # checked where a request is accepted (the Processor)
        check_sampling_params(SamplingParams(**kw))


def test_clone_is_deep():
    sp = SamplingParams(stop=["a"], logit_bias={1: 2.0}, temperature=0.5)
    twin = sp.clone()
    twin.stop.append("b")
    twin.logit_bias[3] = 1.0
    assert sp.stop == ["a"] and sp.logit_bias == {1: 2.0} and twin.temperature == 0.5
    assert twin is not sp and sp.clone() == sp


# --- over HTTP, with the real openai client ------------------------------------------------------------------

NAME = "tiny"


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "core-process"])
def server(chat_model, request):
    """The server over an in-process engine, and over the engine core in its own process (`minivllm serve`)."""
    from minivllm.serve.async_llm import AsyncLLM
    from minivllm.serve.openai_server import ServerThread

    llm = AsyncLLM(chat_model, **ARGS, max_num_batched_tokens=64, multiprocess=request.param)
    with ServerThread(llm, NAME) as srv:
        srv.llm = llm
        yield srv
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


TEXT = "The quick brown fox jumps over the lazy dog. What is the capital of France?"


def test_echo_with_logprobs_returns_the_prompt_logprobs_first(server, client, chat_model):
    from transformers import AutoModelForCausalLM

    ids = server.llm.tokenizer.encode(TEXT)
    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()
    ref = reference_prompt_logprobs(model, ids)
    r = client.completions.create(model=NAME, prompt=TEXT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(TEXT) and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(abs(lp.token_logprobs[j + 1] - ref[j, ids[j + 1]].item()) < 1e-4 for j in range(len(ids) - 1))
    assert all(lp.tokens[j] in lp.top_logprobs[j] for j in range(1, len(lp.tokens)))  # the token, then the top 2
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens[: len(ids)]) == TEXT

    scored = client.completions.create(model=NAME, prompt=TEXT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = scored.choices[0]
    assert c.text == TEXT and c.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert c.logprobs.tokens == lp.tokens[: len(ids)]
    assert c.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[: len(ids)], abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_http_eos_text_is_not_in_the_output(server, client, stream):
    """The API server's own detokeniser (core-process) follows the engine's rule: the EOS that ended a choice
    leaves no text, also with skip_special_tokens false."""
    tok = server.llm.tokenizer
    eos = tok.eos_token_id
    r = client.completions.create(
        model=NAME, prompt=TEXT, max_tokens=6, temperature=0, stream=stream,
        extra_body=dict(min_tokens=2, logit_bias={str(eos): 100}, skip_special_tokens=False),
    )  # fmt: skip
    chunks = list(r) if stream else [r]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert text and tok.eos_token not in text


def test_http_logit_bias_allowed_token_ids_and_bad_values(server, client):
    import openai

    r = client.completions.create(
        model=NAME, prompt=TEXT, max_tokens=4, temperature=0, logit_bias={"401": 100}, logprobs=0,
        extra_body=dict(return_tokens_as_token_ids=True, ignore_eos=True),
    )  # fmt: skip
    assert r.choices[0].logprobs.tokens == ["token_id:401"] * 4
    r = client.completions.create(
        model=NAME, prompt=TEXT, max_tokens=4, temperature=0, logprobs=0,
        extra_body=dict(return_tokens_as_token_ids=True, ignore_eos=True, allowed_token_ids=[7, 9]),
    )  # fmt: skip
    assert set(r.choices[0].logprobs.tokens) <= {"token_id:7", "token_id:9"}
    for extra, message in (
        (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
        (dict(logit_bias={"9999": 1}), "logit_bias token ids [9999] are outside the vocabulary"),
        (dict(allowed_token_ids=[600]), "allowed_token_ids [600] are outside the vocabulary"),
        (dict(prompt=list(range(1, 300))), "maximum context length is 256 tokens"),
    ):
        prompt = extra.pop("prompt", TEXT)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=NAME, prompt=prompt, max_tokens=4, extra_body=extra)
        assert message in str(e.value)
    with pytest.raises(openai.BadRequestError, match="cannot set both continue_final_message and add_generation"):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], extra_body=dict(continue_final_message=True)
        )
    assert_idle(server.llm)


def assert_idle(llm, timeout: float = 10) -> None:
    """Nothing of the refused requests is left: no request in the engine (or in the core and its client)."""
    deadline = time.time() + timeout
    while True:
        if hasattr(llm, "engine"):  # in-process
            idle = not llm.engine.requests
        else:  # the core's gauges after its last step, and the client's table
            idle = (
                not llm.streams
                and not llm.output_processor.requests
                and llm.stats.num_running == llm.stats.num_waiting == 0
            )
        if idle or time.time() > deadline:
            break
        time.sleep(0.05)
    assert idle


# --- LLM(...) as vLLM users call it; chat continuing the last message; the overflow wording ---------------------


def test_vllm_engine_arguments(tiny_qwen3, tmp_path, caplog):
    from transformers import AutoTokenizer

    tokenizer_dir = str(tmp_path / "tok")
    AutoTokenizer.from_pretrained(tiny_qwen3).save_pretrained(tokenizer_dir)
    with caplog.at_level("WARNING", logger="minivllm"):
        engine = LLM(
            tiny_qwen3, tokenizer=tokenizer_dir, trust_remote_code=True, block_size=32, disable_log_stats=True,
            swap_space=4, max_model_len=128, num_kvcache_blocks=16, max_num_seqs=4,
        )  # fmt: skip
    try:
        assert engine.config.kvcache_block_size == 32 and engine.scheduler.block_manager.block_size == 32
        assert engine.config.tokenizer == tokenizer_dir
        for name in ("trust_remote_code", "disable_log_stats", "swap_space"):
            assert any(name in r.getMessage() and "has no effect" in r.getMessage() for r in caplog.records), name
        out = engine.generate([LONG[:40]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
        assert len(out.token_ids) == 4
        with pytest.raises(ValueError, match="maximum context length is 128 tokens"):
            engine.generate([LONG[:120]], SamplingParams(max_tokens=20), use_tqdm=False)
    finally:
        engine.exit()
    with pytest.raises(ValueError, match="kvcache_block_size must be >= 1, got 0"):
        LLM(tiny_qwen3, block_size=0)
    with pytest.raises(ValueError, match="kvcache_block_size must be >= 1, got 2.5"):
        LLM(tiny_qwen3, block_size=2.5)
    with pytest.raises(TypeError, match="give block_size or kvcache_block_size, not both"):
        LLM(tiny_qwen3, block_size=16, kvcache_block_size=16)
    with pytest.raises(FileNotFoundError, match="tokenizer directory"):
        LLM(tiny_qwen3, tokenizer=str(tmp_path / "missing"))


def test_chat_continue_final_message(tiny_qwen3, tmp_path):
    from helpers.tiny_model import CHAT_TEMPLATE, make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / "chat"), "qwen3", chat_template=CHAT_TEMPLATE)
    engine = LLM(path, max_model_len=128, num_kvcache_blocks=16, kvcache_block_size=16, max_num_seqs=4)
    try:
        conversation = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "Paris is"}]
        sp = SamplingParams(temperature=0, max_tokens=3)
        out = engine.chat(conversation, sp, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
        expected = engine.tokenizer.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
        assert out[0].prompt == expected and out[0].prompt.endswith("Paris is")
        with pytest.raises(ValueError, match="cannot set both continue_final_message and add_generation_prompt"):
            engine.chat(conversation, sp, continue_final_message=True, use_tqdm=False)
    finally:
        engine.exit()


@pytest.mark.gpu
def test_gpu_prompt_logprobs_seeded_chunks_and_logits_processors(tiny_qwen3, hf_model):
    """The same on CUDA (decode graphs on): prompt logprobs in fp32 against transformers, a seeded request alone
    and queued behind a long prompt, and a biased greedy run."""
    engine = LLM(tiny_qwen3, device="cuda", dtype="float32", max_num_batched_tokens=200, **ARGS)
    try:
        prompt = LONG[:120]
        out = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
        check_prompt_logprobs(out.prompt_logprobs, prompt, reference_prompt_logprobs(hf_model, prompt), 3)
        engine.reset_prefix_cache()
        sp = SamplingParams(temperature=1.0, seed=77, max_tokens=8, ignore_eos=True)
        alone = engine.generate([LONG], sp, use_tqdm=False)[0].token_ids
        engine.reset_prefix_cache()
        queued = engine.generate([OTHER, LONG], [SamplingParams(max_tokens=8), sp], use_tqdm=False)[1].token_ids
        assert queued == alone
        biased = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={401: 100})
        assert engine.generate([prompt], biased, use_tqdm=False)[0].token_ids == [401] * 4
    finally:
        engine.exit()
