"""Chapter 09: the exponential race (argmax p / E, E ~ Exp(1)) with temperature, and the Sampler's forward
(minivllm/layers/sampler.py): greedy rows, frequencies against softmax(logits / T) by a chi-square test, and
draws from the sampler's own generator only."""

import torch

from helpers.course import assert_exact, odd_size, seeded
from minivllm.layers.sampler import Sampler, exponential_race

CRITICAL = 40.0  # chi-square at p = 1e-5 for up to ~12 degrees of freedom: a right sampler fails 1 run in 1e5


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def frequencies_match(tokens: torch.Tensor, probs: torch.Tensor, exercise: str, what: str) -> None:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    stat = chi_square(counts, probs)
    if stat > CRITICAL:
        n = counts.sum()
        rows = ", ".join(f"{i}: {c / n:.3f} vs {p:.3f}" for i, (c, p) in enumerate(zip(counts, probs.tolist())))
        raise AssertionError(
            f"{exercise}: {what}: frequencies are not softmax(logits / T) (chi-square {stat:.1f} > "
            f"{CRITICAL}); token: drawn vs expected share: {rows}"
        )


def test_greedy_rows():
    gen = seeded(60)
    logits = torch.randn(odd_size(gen, 5, 30), odd_size(gen, 20, 100), generator=gen)
    temps = torch.where(torch.rand(logits.shape[0], generator=gen) < 0.5, 0.0, 0.8)
    got = exponential_race(logits, temps, seeded(1))
    greedy = temps == 0
    assert_exact(got[greedy], logits.argmax(-1)[greedy], "exponential_race", "temperature-0 rows (greedy)")


def test_race_frequencies():
    gen = seeded(61)
    vocab, rows = 7, 20000
    base = torch.randn(vocab, generator=gen) * 1.5
    for t in (0.5, 1.0, 1.7):
        got = exponential_race(base.expand(rows, vocab).clone(), torch.full((rows,), t), seeded(int(t * 10)))
        frequencies_match(got, torch.softmax(base.double() / t, -1), "exponential_race", f"temperature {t}")


def test_sampler_forward():
    """Greedy without temperatures; otherwise the race on the sampler's own generator: two samplers of one seed
    draw the same, whatever torch's global generator does between them."""
    gen = seeded(62)
    logits = torch.randn(odd_size(gen, 5, 30), 11, generator=gen)
    assert_exact(Sampler()(logits, None), logits.argmax(-1), "Sampler.forward", "temperatures None (greedy)")
    temps = torch.full((logits.shape[0],), 0.7)
    a = Sampler(seed=3)(logits, temps)
    torch.rand(100)  # torch's global generator moves on
    b = Sampler(seed=3)(logits, temps)
    assert_exact(b, a, "Sampler.forward", "two samplers of one seed (the draws must use the sampler's generator)")
    rows = 20000
    got = Sampler(seed=4)(logits[:1].expand(rows, -1).clone(), torch.full((rows,), 0.7))
    frequencies_match(got, torch.softmax(logits[0].double() / 0.7, -1), "Sampler.forward", "temperature 0.7")
