"""The sampler (nano-vllm's sampler.py; notebook 09): temperature sampling as an exponential race, argmax(p / E)
with E ~ Exp(1), which draws from p exactly; temperature 0 is greedy. What a request may add (top-k, top-p, min-p,
its own seed) is the front end's, applied before this draw (frontend/sampling_filters.py).

On a GPU the engine's kernel table draws by the inverse CDF instead, in two Triton kernels that need one random
number per row, not one per logit (kernels/triton/sampler.py)."""

import torch
from torch import nn

from minivllm.kernels.table import TORCH, Ops


def exponential_race(
    logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    greedy = logits.argmax(dim=-1)  # (B,)
    t = torch.where(temperatures > 0, temperatures, 1.0)
    probs = torch.softmax(logits / t[:, None], dim=-1)  # (B, V)
    noise = torch.empty_like(probs).exponential_(1, generator=generator).clamp_min_(1e-10)  # E ~ Exp(1)
    sampled = (probs / noise).argmax(dim=-1)  # argmax(p / E) ~ p
    return torch.where(temperatures > 0, sampled, greedy)


class Sampler(nn.Module):
    """The engine's sampler. Its randomness is its own (not torch's global generator), so two engines in one
    process do not shift each other's draws: a device-side seed for the kernels' draw (`ops.draw`, GPU), a
    generator for the torch race (CPU)."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu", ops: Ops = TORCH) -> None:
        super().__init__()
        self.draw = ops.draw  # the kernels' draw (GPU), bound when the engine builds its sampler; None: the race
        self.register_buffer("seed", torch.tensor([seed], dtype=torch.int64, device=device), persistent=False)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def reset(self, seed: int) -> None:
        """Start the random streams again from `seed` (after warm-up and capture drew noise)."""
        self.seed.fill_(seed)
        self.generator.manual_seed(seed)

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor | None) -> torch.Tensor:
        """logits (B, V), temperatures (B,) float (0 = greedy), or None when every row is greedy (no noise drawn).
        Returns (B,) int64 token ids."""
        if temperatures is None:  # in fp32 as vLLM's sampler: on CPU a bf16 argmax is ~5x slower than cast + argmax
            return logits.float().argmax(dim=-1)
        if self.draw is not None:  # the kernels read any float dtype as is
            return self.draw_kernels(logits, temperatures)
        return exponential_race(logits.float(), temperatures, self.generator)

    def draw_kernels(self, logits: torch.Tensor, temperatures: torch.Tensor, out: torch.Tensor | None = None):
        if self.seed.device != logits.device:
            self.seed = self.seed.to(logits.device)
        return self.draw(logits, temperatures, self.seed, out)
