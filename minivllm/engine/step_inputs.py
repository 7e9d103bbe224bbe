"""One step's inputs: built on the host with numpy from the scheduled sequences (nano-vllm's prepare_prefill /
prepare_decode, here plain functions that tests call without a model), then copied to the device in one transfer through
a persistent pinned buffer (`InputBuffers`).

A step computes `num_scheduled_tokens` tokens of each sequence, starting at `num_computed_tokens`: a whole prompt, a
chunk of one, or the one token of a decode. Token t of a sequence lives in cache slot `block_table[t // block_size] *
block_size + t % block_size` (notebook 11 draws it). A token that is still being sampled by the previous step (PENDING,
the engine runs one step ahead) is fed from that step's output on the device: `src` says from which row."""

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.engine.sequence import PENDING, Sequence


@dataclass(slots=True)
class StepInput:
    """One step's inputs as host arrays (what rank 0 sends to the tensor-parallel workers)."""

    is_prefill: bool
    input_ids: np.ndarray  # (T,) int32, 0 where the token is PENDING (see src)
    positions: np.ndarray  # (T,) int32
    slot_mapping: np.ndarray  # (T,) int32, cache slot per token, -1 = write nothing (decode padding)
    context_lens: np.ndarray  # (S,) int32, keys per sequence after this step
    block_tables: np.ndarray | None  # (S, M) int32, -1 padded; None for a prefill without cached keys
    cu_seqlens_q: np.ndarray | None = None  # (S + 1,) int32, prefill: query offsets
    cu_seqlens_k: np.ndarray | None = None  # (S + 1,) int32, prefill: key offsets
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    num_seqs: int = 0  # real sequences (decode may be padded up to a graph size)
    num_decode_rows: int = 0  # prefill with block tables: its first rows with one query each
    src: np.ndarray | None = None  # (T,) int32: row of the previous step's sampled tokens to feed in, or -1


# --- building them (host, numpy) ----------------------------------------------------------------------


def token_slots(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Cache slots of tokens [start, end) of a sequence with this block table: (end - start,) int64."""
    pos = np.arange(start, end)
    table = np.asarray(block_table, dtype=np.int64)
    return table[pos // block_size] * block_size + pos % block_size


def block_tables_of(seqs: list[Sequence], rows: int, width: int | None = None) -> np.ndarray:
    """(rows, width) int32, -1 padded; width defaults to the longest table in the batch."""
    width = width or max(1, max(len(s.block_table) for s in seqs))
    tables = np.full((rows, width), -1, dtype=np.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = s.block_table
    return tables


def pending_sources(input_ids: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
    """Where input_ids holds PENDING, set it to 0 and return the previous step's row to feed it from (-1
    elsewhere); None when no token is pending."""
    pending = input_ids == PENDING
    if not pending.any():
        return None
    input_ids[pending] = 0
    return np.where(pending, rows, -1).astype(np.int32)


def prepare_prefill(seqs: list[Sequence], block_size: int, *, keys_from_cache: bool = False) -> StepInput:
    """A prefill step. Attention reads the keys through block tables when some come from the cache (a prefix
    hit, a later chunk), or always with `keys_from_cache` (FlashAttention-4: one kernel variant for every
    prefill, model_runner.py); otherwise it takes the step's fresh K/V and the tables are None."""
    starts = np.array([s.num_computed_tokens for s in seqs])
    ends = starts + np.array([s.num_scheduled_tokens for s in seqs])
    input_ids = np.concatenate([s.token_ids[a:b] for s, a, b in zip(seqs, starts, ends)]).astype(np.int32)
    positions = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)]).astype(np.int32)
    slots = [token_slots(s.block_table, a, b, block_size) for s, a, b in zip(seqs, starts, ends)]
    cached = keys_from_cache or bool((starts > 0).any())  # attention reads the keys by block table
    rows = np.repeat([s.sample_row for s in seqs], ends - starts)
    # the scheduler puts decoding sequences first: their one query each attends like a decode step, in one batched
    # decode call (on CPU 7% faster than a loop per sequence on a chunked workload; on a GPU about even)
    one = ends - starts == 1
    num_decode_rows = int(one.argmin()) if not one.all() else len(seqs)
    return StepInput(
        is_prefill=True,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=np.concatenate(slots).astype(np.int32),
        context_lens=ends.astype(np.int32),
        block_tables=block_tables_of(seqs, len(seqs)) if cached else None,
        cu_seqlens_q=np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int32),
        cu_seqlens_k=np.concatenate([[0], np.cumsum(ends)]).astype(np.int32),
        max_seqlen_q=int((ends - starts).max()),
        max_seqlen_k=int(ends.max()),
        num_seqs=len(seqs),
        num_decode_rows=num_decode_rows if cached else 0,
        src=pending_sources(input_ids, rows),
    )


def prepare_decode(
    seqs: list[Sequence], block_size: int, *, rows: int, table_width: int | None = None, always_feed: bool = False
) -> StepInput:
    """One token per sequence, padded to `rows` (a captured graph's batch size): padding rows write nothing
    and attend to nothing. `table_width` fixes the block tables' width (graphs read a fixed layout);
    `always_feed` gives a `src` even when nothing is pending (a graph that feeds always reads it)."""
    bs = len(seqs)
    input_ids = np.zeros(rows, dtype=np.int32)
    positions = np.zeros(rows, dtype=np.int32)
    slot_mapping = np.full(rows, -1, dtype=np.int32)
    context_lens = np.zeros(rows, dtype=np.int32)
    for i, s in enumerate(seqs):
        p = s.num_tokens - 1
        input_ids[i], positions[i], context_lens[i] = s.last_token, p, s.num_tokens
        slot_mapping[i] = s.block_table[p // block_size] * block_size + p % block_size
    sample_rows = np.array([s.sample_row for s in seqs] + [-1] * (rows - bs))
    src = pending_sources(input_ids, sample_rows)
    if src is None and always_feed:  # -1 everywhere: keep every id
        src = np.full(rows, -1, dtype=np.int32)
    return StepInput(
        is_prefill=False,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        context_lens=context_lens,
        block_tables=block_tables_of(seqs, rows, table_width),
        num_seqs=bs,
        src=src,
    )


# --- getting them to the device -----------------------------------------------------------------------


ALIGN = 4  # int32s: every array starts 16 bytes aligned, the alignment Triton specialises pointer arguments on
# (a kernel handed a view at an odd offset would compile a second variant inside some later request)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class DecodeLayout:
    """Where each decode input lives in the persistent int32 device buffer, so that a captured graph reads
    the same addresses at every replay: [input_ids S][positions S][slot_mapping S][context_lens S]
    [block_tables S x M][src S]. Capture, replay and benchmarks/profile_decode.py all use this one layout."""

    max_seqs: int  # S
    max_blocks: int  # M, block-table width

    def widths(self) -> dict[str, int]:
        S = self.max_seqs
        return dict(input_ids=S, positions=S, slot_mapping=S, context_lens=S, block_tables=S * self.max_blocks, src=S)

    def offsets(self) -> dict[str, int]:
        """Each field's start (16-byte aligned: the fields before it rounded up to ALIGN)."""
        starts = np.cumsum([0] + [aligned(w) for w in self.widths().values()])  # (fields + 1,)
        return dict(zip(self.widths(), starts.tolist()))

    @property
    def size(self) -> int:
        return sum(aligned(w) for w in self.widths().values())

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of `buffer`; block_tables is (S, M)."""
        views = {name: buffer[o : o + w] for (name, o), w in zip(self.offsets().items(), self.widths().values())}
        views["block_tables"] = views["block_tables"].view(self.max_seqs, self.max_blocks)
        return views


class InputBuffers:
    """The device buffers a step's inputs land in, and the pinned host buffers they travel through. Two host
    buffers are used on alternate steps (`flip`): step N+1 is prepared while step N's copy may be queued."""

    def __init__(self, *, max_tokens: int, layout: DecodeLayout, device: torch.device) -> None:
        S, pin = layout.max_seqs, device.type == "cuda"
        # a prefill's arrays, each starting aligned (up to ALIGN - 1 padding after each of 8)
        ints = max(layout.size, 5 * max_tokens + 2 * (S + 1) + S * layout.max_blocks + 8 * ALIGN)
        self.layout = layout
        self.host_ints = [torch.zeros(ints, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.host_floats = [torch.zeros(2 * S, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self.host_tokens = [torch.zeros(S, dtype=torch.int64, pin_memory=True) for _ in range(2)] if pin else None
        self.ints = torch.zeros(ints, dtype=torch.int32, device=device)
        self.floats = torch.zeros(2 * S, device=device)  # [temperatures S][top_ps S]
        self.decode = layout.views(self.ints)  # what the decode graphs read
        self.temperatures = self.floats[:S]
        self.parity = 0

    def upload(self, arrays: list[np.ndarray], offsets: list[int] | None = None) -> list[torch.Tensor]:
        """Copy host arrays to the device in one transfer. Packed back to back (each start aligned), or at
        `offsets` (decode graphs read fixed places). Returns the device views, shaped like the arrays."""
        host = self.host_ints[self.parity]
        staged = host.numpy()
        starts, end = [], 0
        for i, a in enumerate(arrays):
            start = offsets[i] if offsets else aligned(end)
            staged[start : start + a.size] = a.ravel()
            starts.append(start)
            end = start + a.size
        self.ints[:end].copy_(host[:end], non_blocking=True)
        return [self.ints[o : o + a.size].view(a.shape) for o, a in zip(starts, arrays)]

    def upload_step(self, inp: StepInput, *, at_layout: bool = False) -> dict[str, torch.Tensor]:
        """Every array of a step (those that are not None) in one transfer: packed back to back, or with `at_layout`
        (a decode step) at the decode layout's fixed offsets, which the graphs read. Returns device views by name."""
        names = ["input_ids", "positions", "slot_mapping", "context_lens", "cu_seqlens_q", "cu_seqlens_k"]
        names = [n for n in names + ["block_tables", "src"] if getattr(inp, n) is not None]  # in the layout's order
        offsets = [self.layout.offsets()[n] for n in names] if at_layout else None
        return dict(zip(names, self.upload([getattr(inp, n) for n in names], offsets)))

    def upload_floats(
        self, temperatures: list[float], top_ps: list[float] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Temperatures (and top-p values) of a batch, on the device: (n,) and (n,) or None."""
        S, n = self.layout.max_seqs, len(temperatures)
        host = self.host_floats[self.parity]
        host.numpy()[:n] = temperatures
        if top_ps is not None:
            host.numpy()[S : S + n] = top_ps
        end = S + n if top_ps is not None else n
        self.floats[:end].copy_(host[:end], non_blocking=True)
        return self.floats[:n], self.floats[S : S + n] if top_ps is not None else None

    def clear_decode(self) -> None:
        """Decode inputs that write nothing and attend to nothing (what padding rows hold), before capture."""
        self.decode["slot_mapping"].fill_(-1)
        self.decode["context_lens"].zero_()
        self.decode["block_tables"].fill_(0)
        self.decode["src"].fill_(-1)

    def host_tokens_buffer(self) -> torch.Tensor | None:
        """Pinned host memory this step's sampled tokens are copied back into (GPU only)."""
        return self.host_tokens[self.parity] if self.host_tokens else None

    def flip(self) -> None:
        self.parity ^= 1
