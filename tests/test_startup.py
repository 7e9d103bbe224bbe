"""Start-up work that only a GPU engine does (minivllm/engine/model_runner.py), run on CPU where it can be:
the prefill kernel variants warmed up at start-up must work for every engine shape, including a context no
longer than one block (no prefix can be cached then: only the fresh variant runs)."""

import pytest

from minivllm import LLM, SamplingParams


@pytest.mark.parametrize(
    "block_size,max_model_len,expected",
    [
        (16, 256, [(0, 1), (16, 8), (16, 240)]),
        (256, 256, [(0, 1)]),
        (16, 20, [(0, 1), (16, 4)]),
        (16, 2048, [(0, 1), (16, 8), (16, 512)]),
    ],
)
def test_prefill_variant_warmup_fits_the_engine(tiny_qwen3, block_size, max_model_len, expected):
    llm = LLM(
        tiny_qwen3, device="cpu", kvcache_block_size=block_size, max_model_len=max_model_len, num_kvcache_blocks=8
    )
    runner, runs = llm.model_runner, []
    run_model = runner.run_model

    def recorded(inp, **kwargs):
        runs.append((int(inp.context_lens[0]) - len(inp.input_ids), len(inp.input_ids)))  # (cached, new) tokens
        logits = run_model(inp, **kwargs)
        assert logits.shape[0] == 1 and bool(logits.isfinite().all())
        return logits

    runner.run_model = recorded
    runner.warmup_prefill_variants()
    assert runs == expected
    runner.run_model = run_model  # the engine still answers afterwards
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].token_ids) == 2
    llm.exit()
