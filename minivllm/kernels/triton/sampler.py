"""The sampler's draw on a GPU (layers/sampler.py; notebook 18): the inverse CDF in two Triton kernels instead of
the exponential race, which needs a random number per logit (39 M a step at batch 256 and a 151,936-token
vocabulary, which cost the GPU more than reading the logits); the inverse CDF needs one per row. The first kernel
reads each logits row once and writes per tile of columns its max and softmax mass; the second finds the tile,
then the column, where the running mass passes u * total. The seed lives on the device, so a CUDA graph can
replay the step with a fresh draw each time."""

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # a global a kernel reads must be a constexpr


@triton.jit(do_not_specialize=["tiles_per_program"])  # one compiled kernel whatever the batch
def cdf_tiles_kernel(
    logits_ptr,
    stride,
    temps_ptr,
    seed_ptr,
    max_ptr,
    arg_ptr,
    sum_ptr,
    u_ptr,
    V,
    NT,
    tiles_per_program,
    TILE: tl.constexpr,
    TB: tl.constexpr,
):
    """Program (row, g) reads tiles [g * tiles_per_program, ...) of TILE columns of one logits row, TB tiles at a
    time (one (TB, TILE) load: many bytes in flight), and writes, per tile t: its largest logit m_t, that logit's
    first column, and s_t = sum_i 2^((l_i - m_t) * log2(e) / T), the tile's softmax mass on its own scale.
    Program (row, 0) also draws the row's uniform u (one Philox call)."""
    row, g = tl.program_id(0), tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    t = tl.load(temps_ptr + row)
    c = LOG2E / tl.where(t > 0, t, 1.0)  # log2(e) / T; greedy rows use only the maxima
    offs_t, offs_c = tl.arange(0, TB), tl.arange(0, TILE)
    first = g * tiles_per_program
    for k in range(0, tiles_per_program, TB):
        tiles = first + k + offs_t  # (TB,)
        live = (k + offs_t < tiles_per_program) & (tiles < NT)
        cols = tiles[:, None] * TILE + offs_c[None, :]  # (TB, TILE)
        x = tl.load(row_ptr + cols, mask=live[:, None] & (cols < V), other=-float("inf")).to(tl.float32)
        m = tl.max(x, axis=1)  # (TB,)
        arg = tl.min(tl.where(x == m[:, None], cols, V), axis=1)  # the first column of the max (torch.argmax's ties)
        m_safe = tl.where(m == -float("inf"), 0.0, m)  # a tile of -inf only (filtered out): mass 0
        s = tl.sum(tl.exp2((x - m_safe[:, None]) * c), axis=1)
        tl.store(max_ptr + row * NT + tiles, m, mask=live)
        tl.store(arg_ptr + row * NT + tiles, arg, mask=live)
        tl.store(sum_ptr + row * NT + tiles, s, mask=live)
    if g == 0:
        tl.store(u_ptr + row, tl.rand(tl.load(seed_ptr), row))  # u in [0, 1]: counter (seed, row)


@triton.jit
def cdf_pick_kernel(
    logits_ptr,
    stride,
    temps_ptr,
    seed_ptr,
    max_ptr,
    arg_ptr,
    sum_ptr,
    u_ptr,
    out_ptr,
    V,
    NT,
    TILE: tl.constexpr,
    NT_P2: tl.constexpr,
):
    """One program per row. Greedy (T = 0): the first tile holding the row's max gives its column. Sampled: the
    tiles' masses on one scale, W_t = s_t * 2^((m_t - M) * c), and the target u * sum(W); the first tile whose
    running mass passes the target, then inside it (its TILE logits read again) the first column whose running
    mass does. Program 0 advances the seed: the tiles kernel has finished reading it."""
    row = tl.program_id(0)
    t = tl.load(temps_ptr + row)
    c = LOG2E / tl.where(t > 0, t, 1.0)
    offs = tl.arange(0, NT_P2)  # (NT_P2,) tiles
    valid = offs < NT
    m = tl.load(max_ptr + row * NT + offs, mask=valid, other=-float("inf"))
    M = tl.max(m, axis=0)
    w = tl.load(sum_ptr + row * NT + offs, mask=valid, other=0.0) * tl.exp2((m - M) * c)
    w = tl.where(m == -float("inf"), 0.0, w)  # (NT_P2,) each tile's mass
    run = tl.cumsum(w, axis=0)
    target = tl.load(u_ptr + row) * tl.sum(w, axis=0)
    tile = tl.min(tl.where((run > target) & (w > 0), offs, NT_P2), axis=0)
    tile = tl.where(tile == NT_P2, tl.max(tl.where(w > 0, offs, 0), axis=0), tile)  # u rounded to 1: the last
    before = tl.sum(tl.where(offs == tile, run - w, 0.0), axis=0)  # mass of the tiles before, as `run` summed it
    m_t = tl.max(tl.where(offs == tile, m, -float("inf")), axis=0)
    local = (target - before) / tl.exp2((m_t - M) * c)  # the target inside the tile, on its own scale
    cols = tile * TILE + tl.arange(0, TILE)  # (TILE,)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    p = tl.exp2((x - m_t) * c)  # as the tiles kernel computed it
    run_p = tl.cumsum(p, axis=0)
    col = tl.min(tl.where((run_p > local) & (p > 0), cols, V), axis=0)  # never a filtered token, whatever rounding
    col = tl.where(col == V, tl.max(tl.where(p > 0, cols, 0), axis=0), col)  # rounding: the tile's last token
    greedy_tile = tl.min(tl.where(m == M, offs, NT_P2), axis=0)
    greedy_col = tl.sum(tl.where(offs == greedy_tile, tl.load(arg_ptr + row * NT + offs, mask=valid, other=0), 0))
    tl.store(out_ptr + row, tl.where(t > 0, col, greedy_col).to(tl.int64))
    if row == 0:
        tl.store(seed_ptr, tl.load(seed_ptr) + 1)


def inverse_cdf_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seed: torch.Tensor,
    out: torch.Tensor | None = None,
    tile: int = 1024,
    tiles_per_program: int | None = None,
    per_sm: int = 4,
    tiles_at_once: int = 4,
    num_warps: int = 4,
) -> torch.Tensor:
    """A draw from softmax(logits / T) per row by the inverse CDF: logits (B, V) any float dtype, rows
    contiguous; temperatures (B,) (0 = greedy); `seed` a 1-element int64 tensor, advanced by one. Returns (B,)
    int64 token ids (into `out` when given). The tiles are fixed by `tile`, so the draw does not depend on how
    many tiles each program takes."""
    B, V = logits.shape
    assert logits.stride(1) == 1 and temperatures.shape == (B,) and seed.numel() == 1
    out = out if out is not None else torch.empty(B, dtype=torch.int64, device=logits.device)
    nt = triton.cdiv(V, tile)
    if tiles_per_program is None:  # ~per_sm programs per SM of a 132-SM GPU
        tiles_per_program = triton.cdiv(nt, max(1, min(nt, triton.cdiv(132 * per_sm, B))))
    groups = triton.cdiv(nt, tiles_per_program)
    maxima = torch.empty(B, nt, dtype=torch.float32, device=logits.device)
    args = torch.empty(B, nt, dtype=torch.int32, device=logits.device)
    sums = torch.empty(B, nt, dtype=torch.float32, device=logits.device)
    u = torch.empty(B, dtype=torch.float32, device=logits.device)
    common = (logits, logits.stride(0), temperatures, seed, maxima, args, sums, u)
    cdf_tiles_kernel[(B, groups)](*common, V, nt, tiles_per_program, TILE=tile, TB=tiles_at_once, num_warps=num_warps)
    cdf_pick_kernel[(B,)](*common, out, V, nt, TILE=tile, NT_P2=triton.next_power_of_2(nt), num_warps=num_warps)
    return out
