"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`, vLLM's): for each prompt token after the first,
its log-probability under the model given the tokens before it, its rank, and the top-k there. The LM head
normally reads the last position of each sequence only; the sequences that ask for these need its logits at
every prompt position they compute in a step (a chunk of a long prompt at a time): the model runner keeps the
step's hidden states for them and projects the positions planned here. Logits at position j score token j + 1;
the last prompt position gives the first output token instead. Such requests skip the prefix cache (as vLLM's
do), so every position is computed; a recompute after preemption scores positions already recorded again, and
the front end keeps the first (output_processor.py)."""

from dataclasses import dataclass

import torch

from minivllm.engine.request import EngineOutput
from minivllm.engine.sequence import Sequence
from minivllm.frontend.logprobs import LogprobsTensors, add_sampled, raw_logprobs

SLICE = 1024  # prompt positions scored at once: (SLICE, V) float32 logits, 0.6 GB at a 151,936-token vocabulary


@dataclass(slots=True)
class PromptScoring:
    rows: list[int]  # batch rows whose prompt tokens this step scores
    firsts: list[int]  # per row: index of the first prompt token it scores
    counts: list[int]  # per row: how many
    index: list[int]  # (N,) positions in the step's flat token batch whose logits score them
    targets: list[int]  # (N,) the prompt token each of those positions scores
    k: int  # top-k (the largest asked in the step)


def plan(seqs: list[Sequence]) -> PromptScoring | None:
    """What a prefill step scores: positions j in [computed, computed + scheduled) with j + 1 < prompt length,
    of the sequences 0 of requests that asked (None when no row asks)."""
    p = PromptScoring([], [], [], [], [], 0)
    offset = 0
    for row, seq in enumerate(seqs):
        start, n, k = seq.num_computed_tokens, seq.num_scheduled_tokens, seq.sampling_params.prompt_logprobs
        end = min(start + n, seq.num_prompt_tokens - 1)
        if k is not None and seq.index == 0 and end > start:
            p.rows.append(row)
            p.firsts.append(start + 1)
            p.counts.append(end - start)
            p.index += range(offset, offset + end - start)
            p.targets += seq.token_ids[start + 1 : end + 1]
            p.k = max(p.k, k)
        offset += n
    return p if p.rows else None


@torch.inference_mode()
def score(lm_head, hidden: torch.Tensor, p: PromptScoring) -> LogprobsTensors:
    """hidden (T, hidden) of the step's tokens -> log-probabilities of the planned targets (N rows), SLICE
    positions at a time (a long prompt's (N, V) logits would not fit beside the KV cache)."""
    index = torch.tensor(p.index, device=hidden.device)
    targets = torch.tensor(p.targets, device=hidden.device)
    parts = []
    for start in range(0, len(p.index), SLICE):
        logits = lm_head.project(hidden[index[start : start + SLICE]])  # (n, V)
        logprobs, out = raw_logprobs(logits, list(range(logits.shape[0])), p.k)
        parts.append(add_sampled(out, logprobs, targets[start : start + SLICE]))
    cat = lambda name: torch.cat([getattr(part, name) for part in parts])
    names = ("top_ids", "top_logprobs", "sampled_logprobs", "sampled_ranks")
    return LogprobsTensors(list(range(len(p.index))), *(cat(name) for name in names))


def outputs(seqs: list[Sequence], p: PromptScoring, scored: LogprobsTensors) -> list[EngineOutput]:
    """An output with no token per scored sequence still running (`seqs`: the step's batch), carrying its chunk's
    rows: (first prompt token index, [(top ids, top logprobs, logprob, rank)] per token), which the output
    processor gathers."""
    entries = scored.tolists()
    out, start = [], 0
    for row, first, n in zip(p.rows, p.firsts, p.counts):
        seq = seqs[row]
        if not seq.is_finished:
            rows = [entries[i] for i in range(start, start + n)]
            out.append(EngineOutput(seq.request_id, seq.index, [], prompt_logprobs=(first, rows)))
        start += n
    return out
