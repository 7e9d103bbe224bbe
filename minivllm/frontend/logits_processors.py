"""Per-request changes to the logits before the penalties and the draw, vLLM's: `allowed_token_ids` (every
other token set to -inf), `bad_words` (a bad word's last token set to -inf when the output ends with its other
tokens; a one-token word always), `logit_bias` (added to the named tokens' logits). The host lists which
(row, token) pairs each touches (engine/sampling_inputs.py); here they are applied in place, batched."""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LogitsEdits:
    allowed_rows: torch.Tensor | None = None  # (A,) int64, rows restricted to their allowed tokens
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) the allowed tokens of those rows
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, bias float32)
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) bad words' next tokens


def bad_word_bans(output: list[int], words: list[list[int]]) -> list[int]:
    """The tokens a sequence whose output is `output` may not sample next: the last token of each bad word whose
    other tokens end the output."""
    return [w[-1] for w in words if len(w) <= len(output) + 1 and (len(w) == 1 or output[-(len(w) - 1) :] == w[:-1])]


def apply_logits_edits(logits: torch.Tensor, e: LogitsEdits) -> torch.Tensor:
    """logits (B, V) float32, changed in place: the allowed lists, the bad words, then the biases."""
    if e.allowed is not None:
        keep = torch.zeros_like(logits, dtype=torch.bool)  # (B, V)
        keep[e.allowed] = True
        restricted = torch.zeros(logits.shape[0], 1, dtype=torch.bool, device=logits.device)
        restricted[e.allowed_rows] = True
        logits.masked_fill_(restricted & ~keep, float("-inf"))
    if e.banned is not None:
        logits[e.banned] = float("-inf")
    if e.bias is not None:
        rows, ids, bias = e.bias
        logits.index_put_((rows, ids), bias, accumulate=True)
    return logits
