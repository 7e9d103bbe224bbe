"""What vLLM users write, through the engine and the server, judged against vLLM's documented behaviour: a seeded
request's tokens whatever else is batched, the stop token's text kept out of `text`, prompt logprobs (against
transformers' log-softmax in fp32), `echo` scoring over HTTP, logit_bias / allowed_token_ids / bad_words,
`clone()`, `continue_final_message`, the `LLM(...)` arguments vLLM users pass, and vLLM's overflow wording."""

import pytest
import torch

from minivllm import LLM, SamplingParams

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
