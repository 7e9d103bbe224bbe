"""What happens to a step's logits before temperature and the draw, for the rows that ask for it (vLLM's
definitions; minivllm/sampling_params.py lists the order):

- min_tokens: the stop tokens (EOS and stop_token_ids) get -inf until the output is long enough;
- repetition_penalty r over every token seen (prompt and output): l / r where l > 0, l * r where l <= 0;
- frequency_penalty f and presence_penalty p over the output: l - f * count - p * (count > 0).

Rows are gathered, changed and scattered back, so a batch with one penalised request costs (1, V), not
(B, V). The token counts are built on the device from the token ids each step (no state kept between steps)."""

import torch

from minivllm.sampling_params import SamplingParams


def has_penalties(sp: SamplingParams) -> bool:
    return sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1


def needs_history(sp: SamplingParams) -> bool:
    """Penalties and bad words read every previous token (the engine waits for the step in flight)."""
    return has_penalties(sp) or bool(sp.bad_words)


def ban_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """logits[rows[i], token_ids[i]] = -inf, in place. rows, token_ids: (K,) int64."""
    logits[rows, token_ids] = float("-inf")


def token_counts(rows: torch.Tensor, token_ids: torch.Tensor, num_rows: int, vocab: int) -> torch.Tensor:
    """(num_rows, vocab) float32: how often each token occurs in each row; rows, token_ids: (K,) int64."""
    counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=token_ids.device)
    counts.index_put_((rows, token_ids), torch.ones_like(token_ids, dtype=torch.float32), accumulate=True)
    return counts


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """logits (P, V) float32; output_counts (P, V) float32; prompt_mask (P, V) bool; presence, frequency,
    repetition (P,) float32. Returns the penalised logits (P, V)."""
    seen = prompt_mask | (output_counts > 0)  # (P, V)
    r = repetition[:, None]
    penalised = torch.where(logits > 0, logits / r, logits * r)  # pushes toward less likely either way
    logits = torch.where(seen, penalised, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0)
