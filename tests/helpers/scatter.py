"""The teaching version of store_kvcache (notebook 06 builds it first): move row i of a contiguous (N, D)
tensor to row slot[i] of another, one Triton program per row. No K/V pair, no -1 padding, no strides: the
engine's kernel (kernels/triton/store_kvcache.py) adds those."""

import torch
import triton
import triton.language as tl


@triton.jit
def scatter_kernel(src_ptr, slot_ptr, dst_ptr, D: tl.constexpr):
    idx = tl.program_id(0)  # program idx moves row idx of src
    slot = tl.load(slot_ptr + idx)  # to row slot[idx] of dst
    offs = tl.arange(0, D)  # (D,) column offsets; D must be a power of 2
    row = tl.load(src_ptr + idx * D + offs)  # (D,) the whole row in one load
    tl.store(dst_ptr + slot * D + offs, row)


def scatter_rows(src: torch.Tensor, slot: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
    """dst[slot[i]] = src[i] for a contiguous (N, D) src; dst is (num_rows or N, D), zeros where no row lands."""
    N, D = src.shape
    assert src.is_contiguous() and triton.next_power_of_2(D) == D, "src must be contiguous with D a power of 2"
    assert slot.shape == (N,), f"slot has shape {tuple(slot.shape)}, expected ({N},)"
    dst = torch.zeros(num_rows or N, D, dtype=src.dtype, device=src.device)
    scatter_kernel[(N,)](src, slot, dst, D=D)
    return dst
