"""The engine's sampling end to end: each request's temperature, top-k and top-p reach the sampler row by row through
ModelRunner (engine/model_runner.py -> frontend/sampling_filters.py -> layers/sampler.py), in batches that mix
greedy and sampled requests. Many requests share one prompt, so their tokens are draws from one distribution: the
prefill step's token must follow softmax(logits / T) cut to the request's top-k and top-p, with transformers' logits
on the same weights (chi-square, tests/helpers/stats.py), and so must the decode step's token given the first. Then
the GPU path's Triton kernels inside the engine on CPU (the triton_on_cpu kernel option: the KV-cache store, the
fused prologue and the sampler's inverse-CDF kernels, through the Triton interpreter): the torch paths' greedy
tokens, and draws that fit the same probabilities."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.stats import chi2_gof, chi2_two_sample, fits, reference_probs
from minivllm import LLM, SamplingParams
from minivllm.frontend import sampling_inputs
from minivllm.kernels.triton import attention_prologue, sampler, store_kvcache
from minivllm.layers import attention

PROMPT = [355]  # one token, whose next-token distribution on the tiny model is spread: 0.26, 0.22, 0.12, 0.08...
GROUPS = [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.5, 0, 0.6), (0.8, 6, 0.8)]  # (temperature, top_k, top_p)
GREEDY_EVERY = 8
ARGS = dict(kvcache_block_size=16, max_model_len=16, max_num_seqs=256, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def next_logits(tiny_qwen3):
    """next_logits(token_ids) -> transformers' fp32 logits (vocab,) of the token after them (cached)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    cache = {}

    def logits(ids: list[int]) -> torch.Tensor:
        if tuple(ids) not in cache:
            with torch.no_grad():
                cache[tuple(ids)] = model(torch.tensor([ids])).logits[0, -1].double()
        return cache[tuple(ids)]

    return logits


def follows(ids: torch.Tensor, probs: torch.Tensor) -> bool:
    """Draws `ids` pass the chi-square test of fit to `probs`; a draw where p = 0 fails it."""
    if (probs[ids] == 0).any():
        return False
    return fits(chi2_gof(ids, probs))


def params(group: tuple[float, int, float] | None, max_tokens: int) -> SamplingParams:
    if group is None:  # greedy, the edges of every field spelled out: T = 0, top-k 0 = off, top-p 1 = off
        return SamplingParams(temperature=0, top_k=0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True)
    t, k, p = group
    return SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=max_tokens, ignore_eos=True)


def mixed_batch(groups: list, block: int, mixed: int, max_tokens: int) -> tuple[list[SamplingParams], list]:
    """`block` requests per group, then `mixed` requests cycling through all groups, every GREEDY_EVERY-th one
    greedy: (params, group of each request, None = greedy). With `block` a multiple of max_num_seqs, a step
    holds greedy rows and one group's rows (a top-p group alone decides that the filters run); the last
    steps mix every group."""
    group_of = [g for g in range(len(groups)) for _ in range(block)] + [i % len(groups) for i in range(mixed)]
    group_of = [None if i % GREEDY_EVERY == 0 else g for i, g in enumerate(group_of)]
    return [params(None if g is None else groups[g], max_tokens) for g in group_of], group_of


def record_sampler_calls(llm: LLM, monkeypatch) -> list[tuple[bool, bool, bool]]:
    """Per sampler call: (some row greedy, some row sampled, top-k / top-p tensors passed to the front end's filters
    before this draw)."""
    calls, forward, filtered = [], llm.model_runner.sampler.forward, []
    filters = sampling_inputs.sample  # the front end's filters, then the sampler's draw (frontend/sampling_filters.py)

    def recorded(logits, temperatures):
        t = temperatures if temperatures is not None else torch.zeros(logits.shape[0])
        calls.append((bool((t == 0).any()), bool((t > 0).any()), bool(filtered)))
        return forward(logits, temperatures)

    def recorded_filters(sampler, logits, temperatures, top_ks=None, top_ps=None, **kwargs):
        filtered[:] = [1] if top_ks is not None or top_ps is not None else []
        try:
            return filters(sampler, logits, temperatures, top_ks, top_ps, **kwargs)
        finally:
            filtered.clear()

    llm.model_runner.sampler.forward = recorded
    monkeypatch.setattr(sampling_inputs, "sample", recorded_filters)
    return calls


# --- every request draws from its own distribution -------------------------------------------------------


@pytest.mark.slow
def test_per_request_temperature_top_k_top_p_in_mixed_batches(tiny_qwen3, next_logits, monkeypatch):
    sps, group_of = mixed_batch(GROUPS, block=512, mixed=768, max_tokens=2)  # ~580 draws per group
    # on CPU: there every step goes through Sampler.forward (a GPU engine samples unfiltered decode steps inside its
    # CUDA graph; the GPU kernels' law is test_sampler.py's)
    llm = LLM(tiny_qwen3, **ARGS, num_kvcache_blocks=256, seed=1, device="cpu")
    calls = record_sampler_calls(llm, monkeypatch)
    outs = llm.generate([PROMPT] * len(sps), sps, use_tqdm=False)
    assert all(len(o.token_ids) == 2 for o in outs)
    assert any(not r.is_prefill for r in llm.step_log)  # the second tokens came from decode steps
    assert calls and all(greedy and hot for greedy, hot, _ in calls)  # every step mixed greedy and sampled rows
    assert any(f for *_, f in calls) and any(not f for *_, f in calls)  # with and without filtered rows
    llm.exit()
    tokens = torch.tensor([o.token_ids for o in outs])  # (requests, 2)
    is_group = torch.tensor([-1 if g is None else g for g in group_of])
    l0 = next_logits(PROMPT)
    first = int(l0.argmax())
    greedy = tokens[is_group == -1]
    assert (greedy[:, 0] == first).all() and (greedy[:, 1] == int(next_logits(PROMPT + [first]).argmax())).all()
    for g, (t, k, p) in enumerate(GROUPS):
        draws = tokens[is_group == g]
        assert follows(draws[:, 0], reference_probs(l0, t, k, p)), f"first token of group {GROUPS[g]}"
        mode = int(draws[:, 0].mode().values)  # the decode step, given the most frequent first token
        second = draws[draws[:, 0] == mode, 1]
        assert second.numel() >= 100
        expected = reference_probs(next_logits(PROMPT + [mode]), t, k, p)
        assert follows(second, expected), f"second token of group {GROUPS[g]} after {mode}"
        for h, other in enumerate(GROUPS):  # power: another request's parameters would be caught
            if h != g:
                assert not follows(draws[:, 0], reference_probs(l0, *other)), (GROUPS[g], other)


# --- the GPU path's Triton kernels inside the engine, through the interpreter ----------------------------


def count_calls(monkeypatch, module, name: str) -> list:
    calls, fn = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


PATHS = {  # kernel options; which kernels write the KV cache and sample
    "torch": dict(triton_on_cpu=False, cpu_ops=False),  # the torch definitions (not the C++ ops: test_cpu_ops.py)
    "triton store": dict(triton_on_cpu=True, fused_prologue=False),
    "fused prologue": dict(triton_on_cpu=True, fused_prologue=True),
}


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the Triton interpreter runs only without CUDA (minivllm/__init__.py)"
)
def test_triton_paths_in_the_engine_on_cpu_match_the_torch_paths(tiny_qwen3, next_logits, monkeypatch):
    """Greedy requests beside a sampled one (so every step runs the sampler, the inverse-CDF kernels on the
    Triton paths) give the torch path's tokens, also over a prefix-cache hit; a block of sampled one-token
    requests fits transformers' probabilities on the Triton kernels as on the torch race (their randomness is
    their own)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (1, 7, 23)]
    hit = prompts[2][:16] + [5, 6]  # shares prompt 2's first block: its prefill reads K/V the kernels wrote
    greedy, hot = params(None, 8), SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True)
    singles, single_groups = mixed_batch([(1.0, 0, 1.0), (0.7, 3, 1.0)], block=0, mixed=224, max_tokens=1)
    tokens, draws, counts = {}, {}, {}
    for path, options in PATHS.items():
        kernels = {
            name: count_calls(monkeypatch, module, fn)
            for name, module, fn in (
                ("torch store", attention, "store_kvcache_torch"),
                ("triton store", store_kvcache, "store_kvcache"),
                ("fused prologue", attention_prologue, "attention_prologue"),
                ("sampler kernels", sampler, "inverse_cdf_sample"),
            )
        }
        args = {**ARGS, "max_model_len": 64}
        llm = LLM(tiny_qwen3, **args, num_kvcache_blocks=256, seed=3, device="cpu", kernels=options)
        outs = llm.generate(prompts + prompts[:1], [greedy] * 3 + [hot], use_tqdm=False)
        outs += llm.generate([hit], greedy, use_tqdm=False)
        assert llm.scheduler.block_manager.num_prefix_hits == 1
        tokens[path] = [o.token_ids for o in outs[:3] + outs[4:]]
        if path != "fused prologue":  # the draw does not depend on how K/V were written
            draws[path] = [o.token_ids[0] for o in llm.generate([PROMPT] * len(singles), singles, use_tqdm=False)]
        llm.exit()
        counts[path] = {name: len(c) for name, c in kernels.items()}
        monkeypatch.undo()
    assert tokens["triton store"] == tokens["torch"] and tokens["fused prologue"] == tokens["torch"]
    assert all(len(t) == 8 for t in tokens["torch"])
    ran = {path: {name for name, n in c.items() if n} for path, c in counts.items()}
    assert ran == {
        "torch": {"torch store"},
        "triton store": {"triton store", "sampler kernels"},
        "fused prologue": {"fused prologue", "sampler kernels"},
    }
    l0 = next_logits(PROMPT)
    for path, ids in draws.items():
        ids, group = torch.tensor(ids), torch.tensor([-1 if g is None else g for g in single_groups])
        assert (ids[group == -1] == int(l0.argmax())).all(), path
        for gi, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 3, 1.0)]):
            assert follows(ids[group == gi], reference_probs(l0, t, k, p)), (path, t, k, p)
    a, b = torch.tensor(draws["torch"]), torch.tensor(draws["triton store"])
    assert fits(chi2_two_sample(a, b, l0.numel())) and not torch.equal(a, b)  # same law, other noise
