"""Chi-square tests for samplers (tests/test_sampler.py, tests/test_engine_sampling.py): goodness of fit of
drawn token ids to the probabilities they should follow, homogeneity of two samples, and `reference_probs`,
what sampling with (temperature, top-k, top-p) must draw from, written plainly. Each test is taken at the
0.001 level; the callers also show that a plausible wrong sampler fails it, so the tests have power."""

import torch

# upper 0.001 quantiles of the chi-square distribution, chi2.ppf(0.999, df) (tests/test_sampler.py checks them
# against scipy)
CHI2_999 = {
    1: 10.828,
    2: 13.816,
    3: 16.266,
    4: 18.467,
    5: 20.515,
    6: 22.458,
    7: 24.322,
    8: 26.124,
    9: 27.877,
    10: 29.588,
    11: 31.264,
    12: 32.909,
    13: 34.528,
    14: 36.123,
    15: 37.697,
    16: 39.252,
    17: 40.790,
    18: 42.312,
    19: 43.820,
    20: 45.315,
    21: 46.797,
    22: 48.268,
    23: 49.728,
    24: 51.179,
    25: 52.620,
    26: 54.052,
    27: 55.476,
    28: 56.892,
    29: 58.301,
    30: 59.703,
    31: 61.098,
    32: 62.487,
    33: 63.870,
    34: 65.247,
    35: 66.619,
    36: 67.985,
    37: 69.346,
    38: 70.703,
    39: 72.055,
    40: 73.402,
}


def counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids.flatten().cpu(), minlength=vocab).double()  # (V,)


def chi2_gof(ids: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Goodness of fit of samples `ids` to `probs` (V,): (statistic, degrees of freedom). Tokens of
    probability 0 must never appear. Tokens expected fewer than `min_expected` times are pooled into one cell
    (with the next rarest until the pool reaches it), where the chi-square approximation would not hold."""
    probs = probs.double().cpu()
    observed = counts(ids, probs.numel())
    support = probs > 0
    assert observed[~support].sum() == 0, (
        f"tokens {(~support & (observed > 0)).nonzero().flatten().tolist()} have p = 0"
    )
    expected = ids.numel() * probs[support] / probs[support].sum()  # (cells,)
    observed = observed[support]
    order = expected.argsort()  # rarest first
    rare = int((expected < min_expected).sum())  # the pool: every cell below min_expected ...
    while 0 < rare < expected.numel() and expected[order[:rare]].sum() < min_expected:
        rare += 1  # ... and the next rarest until the pool itself reaches it
    if rare > 1:
        pooled, kept = order[:rare], order[rare:]
        expected = torch.cat([expected[kept], expected[pooled].sum()[None]])
        observed = torch.cat([observed[kept], observed[pooled].sum()[None]])
    return float(((observed - expected) ** 2 / expected).sum()), expected.numel() - 1


def chi2_two_sample(a: torch.Tensor, b: torch.Tensor, vocab: int) -> tuple[float, int]:
    """Homogeneity of two equally sized samples: sum (a_i - b_i)^2 / (a_i + b_i), df = cells - 1."""
    ca, cb = counts(a, vocab), counts(b, vocab)
    assert a.numel() == b.numel()
    used = (ca + cb) > 0
    return float(((ca - cb)[used] ** 2 / (ca + cb)[used]).sum()), int(used.sum()) - 1


def fits(stat_df: tuple[float, int]) -> bool:
    stat, df = stat_df
    return df == 0 or stat < CHI2_999[df]  # df = 0: one token, the support check said it all


def reference_probs(logits_row: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """What sampling with these parameters must draw from, written plainly (vLLM's order): softmax(l / T),
    keep the k most likely, renormalise, keep the smallest prefix whose mass >= p, renormalise."""
    probs = torch.softmax(logits_row.double().cpu() / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    total = sum(probs[i].item() for i in kept)
    nucleus, mass = [], 0.0
    for i in kept:
        nucleus.append(i)
        mass += probs[i].item() / total
        if mass >= top_p:
            break
    out = torch.zeros_like(probs)
    out[nucleus] = probs[nucleus] / probs[nucleus].sum()
    return out
