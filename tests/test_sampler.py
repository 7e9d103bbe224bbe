"""The sampler (layers/sampler.py, the front end's filters in frontend/sampling_filters.py; notebook 09): the
exponential race draws from the right distribution (chi-square against the exact probabilities and against
torch.multinomial), temperature, greedy rows, per-row top-k / top-p, and input validation. Every statistical test
also shows that a wrong sampler fails it, so the tests have power. Many draws are one batched call on a repeated
logits row. The chi-square machinery is tests/helpers/stats.py (the engine-level tests use it too)."""

import pytest
import torch

from helpers.stats import CHI2_999, chi2_gof, chi2_two_sample, fits, reference_probs
from minivllm.frontend.sampling_checks import check_sampling_params
from minivllm.frontend.sampling_filters import filter_top_k_top_p
from minivllm.frontend.sampling_filters import sample as filtered_sample
from minivllm.kernels import pick
from minivllm.layers.sampler import Sampler
from minivllm.sampling_params import SamplingParams

N = 40_000  # draws per distribution: expected counts >= ~800 for the rarest token used below
PROBS = torch.tensor([0.30, 0.22, 0.16, 0.12, 0.08, 0.06, 0.04, 0.02], dtype=torch.float64)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def sample(
    logits_row: torch.Tensor, n: int = N, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """n draws from one logits row in one batched Sampler call: (n,) token ids."""
    logits = logits_row.float().repeat(n, 1)  # (n, V)
    temps = torch.full((n,), float(temperature))
    top_ks = torch.full((n,), top_k, dtype=torch.long) if top_k is not None else None
    top_ps = torch.full((n,), float(top_p)) if top_p is not None else None
    return filtered_sample(Sampler(), logits, temps, top_ks, top_ps)


# --- the exponential race ----------------------------------------------------------------------------


def test_chi2_table_matches_scipy():
    from scipy.stats import chi2  # a dev dependency (pyproject.toml): this test runs in CI

    for df, crit in CHI2_999.items():
        assert abs(chi2.ppf(0.999, df) - crit) < 1e-3


def test_exponential_race_samples_p():
    ids = sample(PROBS.log())
    assert fits(chi2_gof(ids, PROBS))
    reference = torch.multinomial(PROBS, N, replacement=True)
    assert fits(chi2_two_sample(ids, reference, PROBS.numel()))


def test_wrong_samplers_fail_the_same_tests():
    """Power check: the statistics above reject samplers that are close to right but wrong."""
    p = PROBS.float().repeat(N, 1)  # (N, V)
    e = torch.empty_like(p).exponential_(1)
    u = torch.rand_like(p)
    reference = torch.multinomial(PROBS, N, replacement=True)
    for wrong in ((p * e).argmax(-1), (p / u).argmax(-1), (p / e.sqrt()).argmax(-1)):
        assert not fits(chi2_gof(wrong, PROBS))
        assert not fits(chi2_two_sample(wrong, reference, PROBS.numel()))


def test_rare_tokens_are_pooled():
    """A long tail (200 tokens, 165 of them expected < 5 times in 500 draws) is pooled into one cell, where the
    chi-square approximation would not hold: right draws fit, and draws at another temperature still fail."""
    logits = torch.linspace(4.0, -4.0, 200)
    probs = torch.softmax(logits.double(), -1)
    stat, df = chi2_gof(torch.multinomial(probs, 500, replacement=True), probs)
    assert df == 35 and fits((stat, df)), (stat, df)  # 35 cells expected >= 5 times, and the pool
    wrong = torch.multinomial(torch.softmax(logits.double() / 1.5, -1), 500, replacement=True)
    assert not fits(chi2_gof(wrong, probs))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_samples_softmax_of_logits_over_t(temperature):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    ids = sample(logits, temperature=temperature)
    assert fits(chi2_gof(ids, torch.softmax(logits.double() / temperature, -1)))
    assert not fits(chi2_gof(ids, torch.softmax(logits.double(), -1)))  # ignoring T is caught


def test_temperature_zero_rows_are_argmax_in_a_mixed_batch():
    logits = torch.randn(64, 50) * 3  # (B, V)
    temps = torch.tensor([0.0, 1.0] * 32)
    greedy = logits.argmax(-1)
    hot_differs = 0
    for filters in (None, (torch.tensor([0, 5] * 32), torch.tensor([1.0, 0.9] * 32))):
        for _ in range(20):
            ids = filtered_sample(Sampler(), logits, temps, *(filters or ()))
            assert torch.equal(ids[0::2], greedy[0::2])  # T = 0: exactly argmax
            hot_differs += int((ids[1::2] != greedy[1::2]).sum())
    assert hot_differs > 0  # T = 1 rows really sample


# --- top-k and top-p -------------------------------------------------------------------------------

LOGITS = torch.tensor([0.3, 2.0, -1.0, 1.2, 0.9, 1.7, -0.4, 0.0, 0.6, 1.4])  # V = 10, unsorted on purpose


def test_top_k_keeps_only_the_k_best():
    ids = sample(LOGITS, top_k=3)
    assert set(ids.unique().tolist()) == set(LOGITS.topk(3).indices.tolist())
    expected = reference_probs(LOGITS, top_k=3)
    assert fits(chi2_gof(ids, expected))
    assert not fits(chi2_gof(ids, reference_probs(LOGITS, top_k=4)))


@pytest.mark.parametrize("top_p, nucleus", [(1e-6, 1), (0.3, 2), (0.7, 4), (0.9, 7), (1.0, 10)])
def test_top_p_keeps_only_the_nucleus(top_p, nucleus):
    expected = reference_probs(LOGITS, top_p=top_p)
    probs = torch.softmax(LOGITS.double(), -1)
    order = probs.argsort(descending=True)
    assert int((expected > 0).sum()) == nucleus
    assert set((expected > 0).nonzero().flatten().tolist()) == set(order[:nucleus].tolist())
    assert probs[order[:nucleus]].sum() >= top_p and (nucleus == 1 or probs[order[: nucleus - 1]].sum() < top_p)
    ids = sample(LOGITS, top_p=top_p)
    assert set(ids.unique().tolist()) == set(order[:nucleus].tolist())  # first token always kept
    assert fits(chi2_gof(ids, expected))


def test_top_p_is_taken_after_temperature():
    """vLLM's and HF's order: the nucleus of softmax(logits / T), not of softmax(logits)."""
    ids = sample(LOGITS, temperature=3.0, top_p=0.5)
    expected = reference_probs(LOGITS, temperature=3.0, top_p=0.5)
    assert int((expected > 0).sum()) != int((reference_probs(LOGITS, top_p=0.5) > 0).sum())
    assert fits(chi2_gof(ids, expected))


def test_per_row_k_p_and_temperature_in_one_batch():
    groups = [(1.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6), (0.7, 4, 0.8), (2.0, 0, 0.5), (1.5, 6, 0.95), (0.0, 2, 0.5)]
    g = len(groups)
    rows = torch.arange(g * 12_000) % g  # groups interleaved row by row
    temps = torch.tensor([t for t, _, _ in groups])[rows]
    top_ks = torch.tensor([k for _, k, _ in groups])[rows]
    top_ps = torch.tensor([p for _, _, p in groups])[rows]
    ids = filtered_sample(Sampler(), LOGITS.repeat(rows.numel(), 1), temps, top_ks, top_ps)
    for i, (t, k, p) in enumerate(groups):
        got = ids[rows == i]
        if t == 0:
            assert (got == LOGITS.argmax()).all()
            continue
        expected = reference_probs(LOGITS, t, k, p)
        assert set(got.unique().tolist()) == set((expected > 0).nonzero().flatten().tolist()), (t, k, p)
        assert fits(chi2_gof(got, expected)), (t, k, p)


def test_k_zero_and_p_one_mean_off():
    logits = torch.randn(256, 40)
    off_k, off_p = torch.zeros(256, dtype=torch.long), torch.ones(256)
    assert torch.equal(filter_top_k_top_p(logits, off_k, off_p), logits)
    temps = torch.rand(256) + 0.5
    torch.manual_seed(1)
    plain = Sampler()(logits, temps)
    torch.manual_seed(1)
    filtered = filtered_sample(Sampler(), logits, temps, off_k, off_p)
    assert torch.equal(plain, filtered)  # same noise, same draws
    kept = filter_top_k_top_p(logits, torch.full((256,), 3), off_p).isfinite().sum(-1)
    assert (kept == 3).all()


# --- bad input ---------------------------------------------------------------------------------------


def test_sampler_rejects_bad_shapes():
    sampler = Sampler()
    with pytest.raises(ValueError, match=r"logits must be \(num_seqs, vocab\)"):
        filtered_sample(sampler, torch.randn(8), torch.ones(8))
    with pytest.raises(ValueError, match=r"logits must be \(num_seqs, vocab\)"):
        filtered_sample(sampler, torch.randn(2, 3, 8), torch.ones(2))
    with pytest.raises(ValueError, match=r"temperatures must have shape \(4,\)"):
        filtered_sample(sampler, torch.randn(4, 8), torch.ones(3))
    with pytest.raises(ValueError, match=r"top_ks must have shape \(4,\)"):
        filtered_sample(sampler, torch.randn(4, 8), torch.ones(4), torch.zeros(5, dtype=torch.long), torch.ones(4))
    with pytest.raises(ValueError, match=r"top_ps must have shape \(4,\)"):
        filtered_sample(sampler, torch.randn(4, 8), torch.ones(4), None, torch.ones(4, 1))


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("max_tokens", 0), ("top_k", 2.5)],
)
def test_sampling_params_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):  # checked where a request is accepted (the Processor)
        check_sampling_params(SamplingParams(**{field: value}))


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --- the inverse-CDF kernels (the GPU's default; on CPU through the Triton interpreter) ------------------


def test_cdf_greedy_rows_are_argmax_with_first_index_ties():
    from minivllm.kernels.triton.sampler import inverse_cdf_sample

    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (6, 70), generator=g).float().to(DEVICE)  # many ties at the max, 18 tiles of 4
    temps = torch.zeros(6, device=DEVICE)
    for per_program in (1, 3, 18):  # ties across programs too
        ids = inverse_cdf_sample(logits, temps, torch.tensor([0], device=DEVICE), tile=4, tiles_per_program=per_program)
        assert torch.equal(ids, logits.argmax(-1))  # torch.argmax: first max


def test_cdf_draw_does_not_depend_on_the_programs_and_the_seed_advances():
    from minivllm.kernels.triton.sampler import inverse_cdf_sample

    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    temps = torch.tensor([1.0, 0.5, 2.0, 1.0], device=DEVICE)
    seed = torch.tensor([42], device=DEVICE)
    draws = [
        inverse_cdf_sample(logits, temps, torch.tensor([42], device=DEVICE), tile=4, tiles_per_program=n)
        for n in (1, 2, 7, 25)
    ]
    assert all(torch.equal(d, draws[0]) for d in draws)
    again = [inverse_cdf_sample(logits, temps, seed, tile=4) for _ in range(4)]
    assert int(seed) == 46  # one step per call
    assert torch.equal(again[0], draws[0])  # same seed, same draw
    assert len({tuple(a.tolist()) for a in again}) > 1  # new seed, new draw


@pytest.mark.parametrize("u, expected", [(0.0, 2), (0.49, 3), (0.5, 5), (1.0, 9)])
def test_cdf_pick_at_the_ends_of_the_cdf(u, expected):
    """The pick kernel with its uniform set by hand: u = 0 takes the first token with mass, u = 1 (which fp32
    rounding can produce) the last one, never a filtered (-inf) token or a column past the row; the masses here
    are 1:1:1:1, so u < 0.5 takes the second and u = 0.5 (the CDF's step) the third."""
    import triton

    from minivllm.kernels.triton.sampler import cdf_pick_kernel, cdf_tiles_kernel

    row = torch.full((1, 11), -float("inf"), device=DEVICE)  # V = 11: tiles of 4, the last one partial
    row[0, [2, 3, 5, 9]] = 0.0  # four tokens of equal mass, in three tiles; column 10 and the rest filtered
    temps, seed = torch.ones(1, device=DEVICE), torch.tensor([0], device=DEVICE)
    nt = triton.cdiv(11, 4)
    maxima, sums = torch.empty(1, nt, device=DEVICE), torch.empty(1, nt, device=DEVICE)
    args, draw = torch.empty(1, nt, dtype=torch.int32, device=DEVICE), torch.empty(1, device=DEVICE)
    out = torch.empty(1, dtype=torch.int64, device=DEVICE)
    common = (row, 11, temps, seed, maxima, args, sums, draw)
    cdf_tiles_kernel[(1, nt)](*common, 11, nt, 1, TILE=4, TB=2)
    draw.fill_(u)
    cdf_pick_kernel[(1,)](*common, out, 11, nt, TILE=4, NT_P2=4)
    assert out.item() == expected


@pytest.mark.slow
def test_cdf_samples_softmax_of_logits_over_t_across_tiles():
    """600 one-row draws over 7 tokens in tiles of 2, two of them filtered (-inf): chi-square against
    softmax(l / T), and the same test rejects softmax(l), which ignores T."""
    from minivllm.kernels.triton.sampler import inverse_cdf_sample

    probs = torch.tensor([0.3, 0.0, 0.25, 0.2, 0.0, 0.15, 0.1], dtype=torch.float64)
    t = 0.5
    logits = (probs.log() * t).float().repeat(600, 1).to(DEVICE)  # softmax(l / T) = probs; log 0 = -inf
    ids = inverse_cdf_sample(logits, torch.full((600,), t, device=DEVICE), torch.tensor([7], device=DEVICE), tile=2)
    ids = ids.cpu()
    assert not ((ids == 1) | (ids == 4)).any()
    kept = torch.tensor([0, 2, 3, 5, 6])
    dense = torch.searchsorted(kept, ids)  # token id -> its index among the kept tokens
    assert fits(chi2_gof(dense, probs[kept]))
    assert not fits(chi2_gof(dense, torch.softmax(logits[0].double().cpu()[kept], -1)))


@pytest.mark.gpu
def test_gpu_sampler_kernel_samples_p_and_greedy_rows():
    """On CUDA the Sampler takes the Triton race: the full chi-square tests, bf16 logits, mixed greedy rows."""
    sampler = Sampler(seed=3, device="cuda", ops=pick("cuda"))  # a GPU engine's: the kernels' draw
    logits = PROBS.log().float().repeat(N, 1).cuda()  # (N, V)
    ids = sampler(logits, torch.ones(N, device="cuda")).cpu()
    assert fits(chi2_gof(ids, PROBS))
    assert fits(chi2_two_sample(ids, torch.multinomial(PROBS, N, replacement=True), PROBS.numel()))
    big = (torch.randn(64, 151936, device="cuda") * 3).to(torch.bfloat16)  # Qwen3's vocabulary
    temps = torch.tensor([0.0, 0.7] * 32, device="cuda")
    ids = sampler(big, temps)
    assert torch.equal(ids[0::2], big[0::2].argmax(-1))
    assert (ids[1::2] != big[1::2].argmax(-1)).any()


@pytest.mark.gpu
def test_gpu_cdf_kernels_sample_across_qwen3s_vocabulary():
    """The inverse CDF over 151,936 columns (149 tiles), 40,000 draws in batches: PROBS's 8 tokens spread over the
    whole row with every other column filtered (-inf) fit PROBS; and a dense row at T = 0.7 fits softmax(l / T)
    binned into 16 column ranges (the tiles' masses combined on one scale). Each test rejects the same draws
    against the wrong law."""
    from minivllm.kernels.triton.sampler import inverse_cdf_sample

    V, n, seed = 151936, 4_000, torch.tensor([11], device="cuda")
    cols = torch.tensor([3, 1500, 20000, 40961, 77777, 100000, 140000, 151935])
    spread = torch.full((V,), -float("inf"))
    spread[cols] = PROBS.log().float()
    dense, t = torch.randn(V, generator=torch.Generator().manual_seed(2)) * 2, 0.7
    draws = {"spread": [], "dense": []}
    for _ in range(N // n):
        for name, row, temp in (("spread", spread, 1.0), ("dense", dense, t)):
            logits = row.cuda().repeat(n, 1)  # (n, V)
            draws[name].append(inverse_cdf_sample(logits, torch.full((n,), temp, device="cuda"), seed).cpu())
    spread_ids, dense_ids = torch.cat(draws["spread"]), torch.cat(draws["dense"])
    assert torch.isin(spread_ids, cols).all()
    ranks = torch.searchsorted(cols, spread_ids)  # column -> its token of PROBS
    assert fits(chi2_gof(ranks, PROBS)) and not fits(chi2_gof(ranks, PROBS.flip(0)))
    edges = torch.linspace(0, V, 17).long()  # 16 column ranges
    bins = torch.bucketize(dense_ids, edges[1:-1], right=True)
    p = torch.softmax(dense.double() / t, -1)
    expected = torch.stack([p[a:b].sum() for a, b in zip(edges[:-1], edges[1:])])
    wrong = torch.softmax(dense.double(), -1)
    wrong = torch.stack([wrong[a:b].sum() for a, b in zip(edges[:-1], edges[1:])])
    assert fits(chi2_gof(bins, expected)) and not fits(chi2_gof(bins, wrong))
