"""Qwen3ForCausalLM (serving Qwen3, Qwen2 and Llama checkpoints) against transformers on the same weights:
prefill logits of a ragged packed batch, greedy generation over the paged KV cache (driven by hand here,
not by the engine), the same under TP=2 on gloo, and on a GPU with the FlashAttention-4 backend."""

import functools

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import assert_close, assert_greedy_within_bf16, bf16_greedy_margin, teacher_forced_logits
from helpers.prefill import packed_prefill_inputs, prefill_logits
from helpers.spawn import run_tp
from helpers.tiny_model import QWEN3_0_6B, make_tiny_checkpoint
from minivllm.kernels import attention_backends
from minivllm.layers.attention import Attention
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.utils.context import reset_context, set_context
from minivllm.utils.loader import load_model

ARCH_FIXTURES = ["tiny_qwen3", "tiny_qwen2", "tiny_llama"]
PROMPTS = [
    [5, 17, 33, 2, 99, 100, 7],
    [42],
    [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
    [8, 8, 8, 250],
]  # ragged: 7, 1, 20 and 4 tokens
MAX_TOKENS = 32


# --- minivllm side: build, load, and drive the model by hand --------------------------------------------


def build_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu", group=None) -> Qwen3ForCausalLM:
    """The model with the torch definitions and the torch attention backend, sharded over `group` (None: one rank)."""
    hf_config = AutoConfig.from_pretrained(path)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(hf_config, group=group)
    finally:
        torch.set_default_dtype(default)
    load_model(model, path)
    return model.eval()


def set_backend(model: torch.nn.Module, backend: str) -> None:
    """Give every attention layer of `model` one object of the attention backend `backend`, as the runner does."""
    shared = attention_backends.create(backend)
    for m in model.modules():
        if isinstance(m, Attention):
            m.backend = shared


@torch.inference_mode()
def paged_greedy(
    model: Qwen3ForCausalLM,
    prompts: list[list[int]],
    max_tokens: int,
    block_size: int = 4,
    forced: list[list[int]] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding over a paged KV cache: one packed prefill, then one decode step per token. Blocks
    are handed out in a shuffled order, so each sequence's cache really is scattered. Under TP, rank 0
    picks the token and broadcasts it. With `forced` (a reference's tokens per prompt), step s is fed
    forced[i][s] instead of our pick (teacher forcing: every step sees the reference's history). Returns
    our picks and rank 0's logits of every step."""
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    S = len(prompts)
    blocks_per_seq = -(-(max(map(len, prompts)) + max_tokens) // block_size)
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(S * blocks_per_seq, generator=g).view(S, blocks_per_seq).to(device, torch.int32)
    for m in attn:  # (num_blocks, block_size, kv_heads, head_dim)
        m.k_cache = torch.zeros(S * blocks_per_seq, block_size, m.num_kv_heads, m.head_dim, dtype=dtype, device=device)
        m.v_cache = torch.zeros_like(m.k_cache)

    def slots(seq: int, pos: torch.Tensor) -> torch.Tensor:
        return tables[seq, pos // block_size] * block_size + pos % block_size

    def pick(logits: torch.Tensor | None) -> torch.Tensor:
        tokens = logits.argmax(-1) if model.lm_head.tp_rank == 0 else torch.empty(S, dtype=torch.long, device=device)
        if model.lm_head.tp_size > 1:
            dist.broadcast(tokens, 0)
        return tokens  # (S,)

    lens = torch.tensor([len(p) for p in prompts], device=device)
    out, step_logits = [[] for _ in prompts], []
    input_ids, positions, cu = packed_prefill_inputs(prompts, device)
    slot_mapping = torch.cat([slots(i, torch.arange(len(p), device=device)) for i, p in enumerate(prompts)])
    set_context(
        True,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=int(lens.max()),
        max_seqlen_k=int(lens.max()),
        slot_mapping=slot_mapping.int(),
        context_lens=lens.int(),
    )
    for step in range(max_tokens):
        logits = model.compute_logits(model(input_ids, positions))  # (S, vocab) on rank 0, else None
        step_logits.append(logits)
        input_ids = pick(logits)
        for i, t in enumerate(input_ids.tolist()):
            out[i].append(t)
        if forced is not None:
            input_ids = torch.tensor([f[step] for f in forced], device=device)
        positions, lens = lens.clone(), lens + 1  # the new token sits at position len
        slot_mapping = torch.stack([slots(i, positions[i]) for i in range(S)]).int()
        set_context(False, slot_mapping=slot_mapping, context_lens=lens.int(), block_tables=tables)
    reset_context()
    return out, step_logits


# --- transformers side ---------------------------------------------------------------------------------


def hf_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()


@torch.inference_mode()
def hf_last_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    device = model.device
    return torch.stack([model(torch.tensor([p], device=device)).logits[0, -1] for p in prompts])  # (S, vocab)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy by full recomputation each step (no cache on the reference side at all; no EOS stop: random
    models emit EOS anywhere). Returns the tokens and the logits (vocab,) of every step."""
    ids, logits = list(prompt), []
    for _ in range(max_tokens):
        logits.append(model(torch.tensor([ids], device=model.device)).logits[0, -1])
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt) :], logits


@functools.lru_cache(None)
def hf_greedy_tokens(path: str, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """transformers' fp32 greedy tokens for PROMPTS (cached: several tests compare against them)."""
    model = hf_model(path)
    return [hf_greedy(model, p, max_tokens)[0] for p in PROMPTS]


# --- CPU tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_prefill_logits_match_transformers_fp32(fixture, request):
    path = request.getfixturevalue(fixture)
    ours = prefill_logits(build_model(path), PROMPTS)  # one packed ragged batch
    ref = hf_last_logits(hf_model(path), PROMPTS)  # one sequence at a time
    assert ours.shape == (len(PROMPTS), AutoConfig.from_pretrained(path).vocab_size)
    assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_prefill_logits_match_transformers_bf16(fixture, request):
    """Both in bf16. They round at different places (we add the residual in fp32 inside RMSNorm), so
    beyond closeness the fair check is that we are as accurate as transformers against the fp32 logits."""
    path = request.getfixturevalue(fixture)
    ours = prefill_logits(build_model(path, torch.bfloat16), PROMPTS)
    ref = hf_last_logits(hf_model(path, torch.bfloat16), PROMPTS)
    truth = hf_last_logits(hf_model(path), PROMPTS).double()
    assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
    scale = truth.abs().max().item()  # ~15: these random logits are large
    assert_close(ours.float(), ref.float(), dtype=torch.bfloat16, atol=0.1 * scale, rtol=0)
    err, ref_err = (ours.double() - truth).abs(), (ref.double() - truth).abs()
    assert err.max() <= 2 * ref_err.max() and err.mean() <= 2 * ref_err.mean(), (
        f"bf16 error vs fp32: ours max {err.max():.3g} mean {err.mean():.3g}, "
        f"transformers max {ref_err.max():.3g} mean {ref_err.mean():.3g}"
    )
    assert (ours.argmax(-1) == truth.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_greedy_matches_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    model, expected = build_model(path), hf_greedy_tokens(path)
    # exact equality is safe in fp32: along these paths the smallest top-2 logit gap is > 2e-3, while the two
    # implementations differ by ~1e-5
    single, _ = paged_greedy(model, PROMPTS[:1], MAX_TOKENS)
    assert single == expected[:1]
    batch, _ = paged_greedy(model, PROMPTS, MAX_TOKENS)
    assert batch == expected
    assert len({tuple(t) for t in batch}) == len(PROMPTS)  # not a degenerate model: outputs differ


def test_greedy_bf16_agrees_up_to_near_ties(tiny_qwen3):
    """bf16 on both sides, ours fed transformers' tokens so that every step is compared (else a wrong token
    at the first near-tie would hide every later step): ours must pick transformers' token unless the fp32
    model's logits of the two are closer than twice the error bf16 makes on the fp32 top-2 gap (measured on
    transformers: 0.25, a margin of 0.49, where the mean top-2 gap is 1.2). 88 of the 128 steps are clear
    of it: there only transformers' token passes."""
    model, ref = build_model(tiny_qwen3, torch.bfloat16), hf_model(tiny_qwen3, torch.bfloat16)
    ref_runs = [hf_greedy(ref, p, MAX_TOKENS) for p in PROMPTS]
    ref_tokens = [t for t, _ in ref_runs]
    truth_model = hf_model(tiny_qwen3)
    truth = [teacher_forced_logits(truth_model, p, t) for p, t in zip(PROMPTS, ref_tokens)]
    margin = bf16_greedy_margin([torch.stack(l) for _, l in ref_runs], truth)
    assert margin < 0.05 * max(t.abs().max().item() for t in truth)  # tighter than a 5%-of-max-logit rule
    tokens, _ = paged_greedy(model, PROMPTS, MAX_TOKENS, forced=ref_tokens)
    compared, total = assert_greedy_within_bf16(tokens, ref_tokens, truth, margin)
    assert compared >= 0.6 * total, f"only {compared} of {total} steps are clear of the margin {margin:.3f}"
    assert all(t[0] == r[0] for t, r in zip(tokens, ref_tokens))  # the prefill's token: no near-tie there


def tp_worker(rank: int, world_size: int, path: str, prompts: list[list[int]], max_tokens: int):
    """Runs in each gloo process (module level so spawn can import it)."""
    torch.manual_seed(0)
    model = build_model(path, group=dist.group.WORLD)
    assert model.model.layers[0].self_attn.num_heads == 4 // world_size
    logits = prefill_logits(model, prompts)
    tokens, _ = paged_greedy(model, prompts, max_tokens)
    return tokens, (logits if rank == 0 else None)


@pytest.mark.slow
def test_tp2_greedy_matches_transformers(tiny_qwen3):
    assert AutoConfig.from_pretrained(tiny_qwen3).num_attention_heads == 4
    results = run_tp(tp_worker, 2, (tiny_qwen3, PROMPTS, MAX_TOKENS))
    expected = hf_greedy_tokens(tiny_qwen3)
    (tokens0, logits0), (tokens1, logits1) = results
    assert logits1 is None  # the LM head gathers onto rank 0 only
    assert_close(logits0, hf_last_logits(hf_model(tiny_qwen3), PROMPTS), atol=1e-4, rtol=1e-4)
    assert tokens0 == expected and tokens1 == expected


def test_unsupported_architecture_is_a_clear_error(tiny_qwen3):
    config = AutoConfig.from_pretrained(tiny_qwen3)
    config.architectures = ["MistralForCausalLM"]
    with pytest.raises(ValueError, match=r"unsupported architecture \['MistralForCausalLM'\].*LlamaForCausalLM"):
        Qwen3ForCausalLM(config)
    config.architectures = None
    with pytest.raises(ValueError, match="unsupported architecture"):
        Qwen3ForCausalLM(config)


def test_tied_embeddings_share_one_storage(tiny_qwen3, tiny_llama):
    tied = build_model(tiny_qwen3)
    assert AutoConfig.from_pretrained(tiny_qwen3).tie_word_embeddings
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    ref = hf_model(tiny_qwen3)
    assert torch.equal(tied.lm_head.weight, ref.lm_head.weight)  # loading embed_tokens filled the head
    with torch.no_grad():
        tied.model.embed_tokens.weight[0, 0] += 1.0  # one write shows through both
    assert tied.lm_head.weight[0, 0] == tied.model.embed_tokens.weight[0, 0]
    untied = build_model(tiny_llama)
    assert not AutoConfig.from_pretrained(tiny_llama).tie_word_embeddings
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    assert torch.equal(untied.lm_head.weight, hf_model(tiny_llama).lm_head.weight)


# --- GPU tests (skipped without CUDA) ---------------------------------------------------------------------


def gpu_backends() -> list[str]:
    from minivllm.kernels.attention_backends import available

    return available("cuda") if torch.cuda.is_available() else ["fa4", "torch"]


@pytest.fixture(scope="module")
def gpu_qwen3(tmp_path_factory) -> str:
    # head_dim 64: a size every FlashAttention build supports (the CPU fixtures use 16)
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("gpu_qwen3")), "qwen3", hidden_size=128, head_dim=64)


def first_divergence_is_near_tie(
    tokens: list[list[int]], ref_tokens: list[list[int]], ref_logits: list[list[torch.Tensor]], margin: float
) -> None:
    """Greedy outputs must agree until a step where the reference's top-2 logits (ref_logits[seq][step])
    are within `margin`: a bf16 near-tie, where either argmax is right; after that they may differ."""
    for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
        assert len(a) == len(b), f"sequence {i}: {len(a)} tokens, reference has {len(b)}"
        step = next((s for s, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is not None:
            top2 = ref_logits[i][step].float().topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < margin, f"sequence {i} differs at step {step}, where the reference's top-2 gap is {gap:.3g}"


def per_sequence(step_logits: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """paged_greedy's per-step (S, vocab) logits -> [seq][step] (vocab,)."""
    return [[step[i] for step in step_logits] for i in range(step_logits[0].shape[0])]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fa4", "torch"])
def test_gpu_greedy_matches_transformers(gpu_qwen3, backend):
    if backend not in gpu_backends():
        pytest.skip(f"attention backend {backend!r} is not available on this GPU")
    dtype = torch.bfloat16 if backend == "fa4" else torch.float32  # FlashAttention has no fp32
    model = build_model(gpu_qwen3, dtype, "cuda")
    set_backend(model, backend)
    ref = hf_model(gpu_qwen3, dtype, "cuda")
    ref_logits = hf_last_logits(ref, PROMPTS)
    ours = prefill_logits(model, PROMPTS)
    scale = ref_logits.float().abs().max().item()
    if dtype == torch.float32:
        assert_close(ours, ref_logits, atol=1e-3, rtol=1e-3)
    else:
        assert_close(ours.float(), ref_logits.float(), dtype=dtype, atol=0.1 * scale, rtol=0)
    ref_runs = [hf_greedy(ref, p, MAX_TOKENS) for p in PROMPTS]
    expected = [t for t, _ in ref_runs]
    block_size = 128 if backend == "fa4" else 16
    if dtype == torch.float32:
        assert paged_greedy(model, PROMPTS, MAX_TOKENS, block_size=block_size)[0] == expected
    else:  # bf16 rounds differently: as test_greedy_bf16_agrees_up_to_near_ties, every step teacher forced
        truth_model = hf_model(gpu_qwen3, torch.float32, "cuda")
        truth = [teacher_forced_logits(truth_model, p, t) for p, t in zip(PROMPTS, expected)]
        margin = bf16_greedy_margin([torch.stack(l) for _, l in ref_runs], truth)
        tokens, _ = paged_greedy(model, PROMPTS, MAX_TOKENS, block_size=block_size, forced=expected)
        compared, total = assert_greedy_within_bf16(tokens, expected, truth, margin)
        assert compared >= 0.5 * total, f"only {compared} of {total} steps are clear of the margin {margin:.3f}"


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_qwen3_0_6b_fa4_matches_torch_backend(tmp_path):
    """Qwen3-0.6B's exact shapes (random weights) in bf16: FlashAttention-4 is as accurate as the torch
    backend against the fp32 model, and greedy tokens agree up to a near-tie."""
    if "fa4" not in gpu_backends():
        pytest.skip("FlashAttention-4 is not available on this GPU")
    path = make_tiny_checkpoint(
        str(tmp_path / "qwen3_0_6b"), "qwen3", dtype=torch.bfloat16, **{**QWEN3_0_6B, "initializer_range": 0.02}
    )
    assert AutoConfig.from_pretrained(path).num_hidden_layers == 28
    prompts = [[(37 * i + 11 * j) % 151936 for j in range(n)] for i, n in enumerate([5, 130, 17, 300])]
    exact = prefill_logits(build_model(path, torch.float32, "cuda"), prompts).float()  # torch backend, fp32
    model = build_model(path, torch.bfloat16, "cuda")
    results = {}
    for backend in ("torch", "fa4"):
        set_backend(model, backend)
        results[backend] = prefill_logits(model, prompts).float(), *paged_greedy(model, prompts, 16, block_size=256)
    (l_t, tok_t, steps_t), (l_f, tok_f, _) = results["torch"], results["fa4"]
    err_t, err_f = (l_t - exact).abs(), (l_f - exact).abs()
    assert err_f.max() <= 2 * err_t.max() and err_f.mean() <= 2 * err_t.mean(), (
        f"bf16 error vs fp32: fa4 max {err_f.max():.3g} mean {err_f.mean():.3g}, "
        f"torch max {err_t.max():.3g} mean {err_t.mean():.3g}"
    )
    first_divergence_is_near_tie(tok_f, tok_t, per_sequence(steps_t), margin=4 * err_t.max().item())
