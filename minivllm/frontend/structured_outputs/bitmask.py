"""A step's token bitmask (xgrammar's layout): row i holds ceil(V / 32) int32 words, bit j of word w set when
token 32 w + j may come next in row i's grammar. Rows without a grammar are all ones (-1) and are not touched.
The mask is filled on the host by the rows' matchers, copied to the device, and applied to the logits in place
before the draw: disallowed logits become -inf (xgrammar's kernel: CUDA on a GPU, C++ on CPU)."""

from dataclasses import dataclass

import torch


def matcher_of(seq):
    """The sequence's grammar matcher (manager.py attaches it), or None when it has no grammar."""
    return getattr(seq, "grammar", None)


@dataclass(slots=True)
class GrammarMask:
    rows: list[int]  # the batch rows that have a grammar
    bitmask: torch.Tensor  # (B, ceil(V / 32)) int32 on the device; -1 (every bit set) in rows without one
    vocab: int  # V, the model's vocabulary (the logits may be padded wider)


def num_words(vocab: int) -> int:
    return -(-vocab // 32)


def grammar_mask(seqs: list, vocab: int, device: torch.device) -> GrammarMask | None:
    """The step's mask (None when no row has a grammar). Each matcher writes its row: the tokens its grammar
    allows after what the sequence has produced (every token of it is known: llm_engine.py waits for them)."""
    rows = [i for i, seq in enumerate(seqs) if matcher_of(seq) is not None]
    if not rows:
        return None
    bitmask = torch.full((len(seqs), num_words(vocab)), -1, dtype=torch.int32)  # (B, W)
    for i in rows:
        matcher_of(seqs[i]).fill_next_token_bitmask(bitmask, i)
    return GrammarMask(rows=rows, bitmask=bitmask.to(device, non_blocking=True), vocab=vocab)


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """Set to -inf, in place, the logits (B, >= V) of the tokens the rows' grammars do not allow."""
    import xgrammar as xgr  # here, not at import: only engines that meet a grammar pay for loading it

    xgr.apply_token_bitmask_inplace(logits, mask.bitmask, vocab_size=mask.vocab, indices=mask.rows)
    if logits.shape[-1] > mask.vocab:  # padded ids are never tokens
        logits[mask.rows, mask.vocab :] = float("-inf")


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bitmask (B, W) int32 unpacked to (B, V) bool: True where the token is allowed (the torch reading of
    the layout, to check xgrammar's kernel against)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # (32,)
    return ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]  # (B, W, 32) -> (B, V)
