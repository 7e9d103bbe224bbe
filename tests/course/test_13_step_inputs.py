"""Chapter 13: a step's inputs (minivllm/engine/step_inputs.py): token slots from a block table (at any start),
padded block tables, the pending tokens fed from the previous step, a prefill's and a decode's StepInput, each
field computed here token by token from its definition."""

import numpy as np

from minivllm.engine.sequence import PENDING, Sequence
from minivllm.engine.step_inputs import block_tables_of, pending_sources, prepare_decode, prepare_prefill, token_slots

BS = 5


def same(got, want, exercise: str, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise AssertionError(f"{exercise}: {what}: expected shape {want.shape}, got {got.shape}")
    diff = np.flatnonzero(got.ravel() != want.ravel())
    if diff.size:
        i = np.unravel_index(diff[0], want.shape)
        raise AssertionError(
            f"{exercise}: {what}: {diff.size} of {want.size} differ; first at index {tuple(int(j) for j in i)}: "
            f"expected {want[i]}, got {got[i]}\n  expected {want.tolist()}\n  got      {got.tolist()}"
        )


def slot(table: list[int], t: int) -> int:
    return table[t // BS] * BS + t % BS


def seq(n: int, table: list[int], computed: int, scheduled: int, row: int = -1) -> Sequence:
    s = Sequence(list(range(100, 100 + n)))
    s.block_table, s.num_computed_tokens, s.num_scheduled_tokens, s.sample_row = table, computed, scheduled, row
    return s


def test_token_slots_from_any_start():
    table = [7, 2, 9, 4]
    for start, end in ((0, 3), (3, 12), (11, 17), (5, 6)):
        want = [slot(table, t) for t in range(start, end)]
        same(token_slots(table, start, end, BS), want, "token_slots", f"tokens [{start}, {end})")


def test_block_tables_padded():
    seqs = [seq(3, [4], 0, 3), seq(12, [7, 2, 9], 0, 12)]
    same(block_tables_of(seqs, 3), [[4, -1, -1], [7, 2, 9], [-1, -1, -1]], "block_tables_of", "3 rows, -1 padded")
    same(block_tables_of(seqs, 2, 5), [[4, -1, -1, -1, -1], [7, 2, 9, -1, -1]], "block_tables_of", "width 5")


def test_pending_sources():
    ids = np.array([5, PENDING, 6, PENDING], dtype=np.int64)
    src = pending_sources(ids, np.array([0, 3, 1, 2]))
    same(src, [-1, 3, -1, 2], "pending_sources", "rows that feed the pending tokens")
    same(ids, [5, 0, 6, 0], "pending_sources", "input ids, pending ones set to 0")
    assert pending_sources(np.array([1, 2]), np.array([0, 1])) is None, "pending_sources: nothing pending is None"


def test_prepare_prefill_with_prefix_and_chunks():
    # a decode row first, a prefix hit (8 cached, 6 new), a later chunk (start 5, 4 tokens)
    seqs = [seq(9, [3, 1], 8, 1, row=0), seq(14, [6, 0, 8], 8, 6), seq(20, [2, 5, 4, 7], 5, 4)]
    x = prepare_prefill(seqs, BS)
    spans = [(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens) for s in seqs]
    ex = "prepare_prefill"
    same(x.input_ids, [s.token_ids[t] for s, (a, b) in zip(seqs, spans) for t in range(a, b)], ex, "input_ids")
    same(x.positions, [t for a, b in spans for t in range(a, b)], ex, "positions")
    same(
        x.slot_mapping,
        [slot(s.block_table, t) for s, (a, b) in zip(seqs, spans) for t in range(a, b)],
        ex,
        "slot_mapping",
    )
    same(x.context_lens, [b for _, b in spans], ex, "context_lens (keys after this step)")
    same(x.cu_seqlens_q, [0, 1, 7, 11], ex, "cu_seqlens_q")
    same(x.cu_seqlens_k, [0, 9, 23, 32], ex, "cu_seqlens_k")
    assert (x.max_seqlen_q, x.max_seqlen_k) == (6, 14), f"{ex}: max_seqlen_q/k {x.max_seqlen_q}, {x.max_seqlen_k}"
    same(x.block_tables, [[3, 1, -1, -1], [6, 0, 8, -1], [2, 5, 4, 7]], ex, "block_tables (keys in the cache)")
    assert x.is_prefill and x.num_seqs == 3 and x.num_decode_rows == 1, (
        f"{ex}: is_prefill, 3 sequences, 1 decode row first; got {x.is_prefill}, {x.num_seqs}, {x.num_decode_rows}"
    )
    fresh = prepare_prefill([seq(7, [4, 2], 0, 7)], BS)
    assert fresh.block_tables is None, f"{ex}: a prefill with no cached keys has no block tables"


def test_prepare_decode_padded():
    seqs = [seq(9, [3, 1], 8, 1), seq(5, [6], 4, 1), seq(16, [2, 5, 4, 7], 15, 1)]
    x = prepare_decode(seqs, BS, rows=5, table_width=6)
    ex = "prepare_decode"
    same(x.input_ids, [108, 104, 115, 0, 0], ex, "input_ids (last tokens, padding 0)")
    same(x.positions, [8, 4, 15, 0, 0], ex, "positions")
    same(
        x.slot_mapping, [slot([3, 1], 8), slot([6], 4), slot([2, 5, 4, 7], 15), -1, -1], ex, "slot_mapping (padding -1)"
    )
    same(x.context_lens, [9, 5, 16, 0, 0], ex, "context_lens (padding 0)")
    same(x.block_tables[:3, :4], [[3, 1, -1, -1], [6, -1, -1, -1], [2, 5, 4, 7]], ex, "block_tables")
    assert x.block_tables.shape == (5, 6) and not x.is_prefill and x.num_seqs == 3, (
        f"{ex}: tables (5, 6), a decode of 3 real rows; got {x.block_tables.shape}, {x.is_prefill}, {x.num_seqs}"
    )
