"""A packed varlen prefill of a few prompts through a model, outside the engine: the step context set by hand,
last-token logits out (tests of the model, and chapter 10's course check)."""

import torch

from minivllm.utils.context import reset_context, set_context


def packed_prefill_inputs(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(p) for p in prompts])
    input_ids = torch.tensor([t for p in prompts for t in p], device=device)  # (T,)
    positions = torch.cat([torch.arange(n) for n in lens.tolist()]).to(device)  # (T,)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(device, torch.int32)  # (S + 1,)
    return input_ids, positions, cu_seqlens


@torch.inference_mode()
def prefill_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """One packed varlen prefill over fresh K/V: last-token logits (S, vocab). Slots -1: if the model
    has a KV cache, nothing is written to it."""
    device = model.lm_head.weight.device
    input_ids, positions, cu = packed_prefill_inputs(prompts, device)
    m = max(len(p) for p in prompts)
    set_context(
        True,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=m,
        max_seqlen_k=m,
        slot_mapping=torch.full_like(input_ids, -1, dtype=torch.int32),
    )
    try:
        return model.compute_logits(model(input_ids, positions))
    finally:
        reset_context()
