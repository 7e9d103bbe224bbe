"""Chapter 09: the exponential race (argmax p / E, E ~ Exp(1)) with temperature, and a seeded row's draw
(minivllm/layers/sampler.py): greedy rows, frequencies against softmax(logits / T) by a chi-square test, and
a seeded draw that depends on its own generator only."""

import torch

from helpers.course import assert_exact, odd_size, seeded
from minivllm.layers.sampler import exponential_race, seeded_draw

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


def test_seeded_draw():
    gen = seeded(62)
    logits = torch.randn(11, generator=gen)
    t = torch.tensor(0.7)
    a = [int(seeded_draw(logits, t, seeded(s))) for s in range(4)]
    b = [int(seeded_draw(logits, t, seeded(s))) for s in range(4)]
    assert a == b, f"seeded_draw: the same seed drew {a} then {b}: a seeded row must depend on its generator only"
    g = seeded(5)
    got = torch.tensor([int(seeded_draw(logits, t, g)) for _ in range(3000)])
    frequencies_match(got, torch.softmax(logits.double() / 0.7, -1), "seeded_draw", "3000 draws of one generator")
