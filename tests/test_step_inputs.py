"""A step's inputs built on the host (minivllm/engine/step_inputs.py), without a model: slots from block tables,
packed prefill of a fresh prompt beside a later chunk of another, decode padded to a graph size, PENDING tokens
fed from the previous step's rows, and the one fixed layout the decode graphs read."""

import numpy as np
import pytest
import torch

from minivllm.engine.sequence import PENDING, Sequence
from minivllm.engine.step_inputs import DecodeLayout, InputBuffers, prepare_decode, prepare_prefill, token_slots

BS = 4  # tokens per block


def seq(tokens: list[int], table: list[int], computed: int, scheduled: int, row: int = -1) -> Sequence:
    s = Sequence(tokens)
    s.block_table, s.num_computed_tokens, s.num_scheduled_tokens, s.sample_row = table, computed, scheduled, row
    return s


def test_token_slots_follow_the_block_table():
    assert token_slots([7, 2], 2, 6, BS).tolist() == [30, 31, 8, 9]  # block 7 slots 28..31, block 2 from 8


def test_prefill_packs_a_fresh_prompt_and_a_later_chunk():
    a = seq([11, 12, 13], [5], 0, 3)  # fresh: 3 tokens
    b = seq(list(range(20, 30)), [1, 4, 6], 4, 5)  # its first block cached: tokens 4..8
    inp = prepare_prefill([a, b], BS)
    assert inp.is_prefill and inp.num_seqs == 2
    assert inp.input_ids.tolist() == [11, 12, 13, 24, 25, 26, 27, 28]
    assert inp.positions.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]
    assert inp.slot_mapping.tolist() == [20, 21, 22, 16, 17, 18, 19, 24]
    assert inp.cu_seqlens_q.tolist() == [0, 3, 8] and inp.cu_seqlens_k.tolist() == [0, 3, 12]
    assert inp.context_lens.tolist() == [3, 9] and (inp.max_seqlen_q, inp.max_seqlen_k) == (5, 9)
    assert inp.block_tables.tolist() == [[5, -1, -1], [1, 4, 6]]  # keys from the cache: tables, -1 padded
    assert inp.src is None
    assert prepare_prefill([a], BS).block_tables is None  # nothing cached: attention needs no table


def test_prefill_counts_its_leading_rows_of_one_query():
    """The scheduler puts decoding sequences first; their rows (one query each) are attended as decode rows."""
    dec = [seq([1, 2, 3, 4, 5], [3, 8], 4, 1), seq([6, 7], [2], 1, 1)]  # one new token each
    chunk = seq(list(range(10, 20)), [1, 4, 6], 4, 5)  # a later chunk of 5
    last = seq([9, 9, 9], [7], 2, 1)  # a prompt's last chunk of one token, after the chunk
    assert prepare_prefill(dec + [chunk, last], BS).num_decode_rows == 2  # the leading run only
    assert prepare_prefill([chunk] + dec, BS).num_decode_rows == 0
    assert prepare_prefill(dec, BS).num_decode_rows == 2  # every row
    fresh = [seq([1], [0], 0, 1), seq([4, 5, 6], [2], 0, 3)]  # nothing cached: no tables, no decode rows
    assert prepare_prefill(fresh, BS).num_decode_rows == 0
    assert prepare_prefill(fresh, BS, keys_from_cache=True).num_decode_rows == 1


def test_decode_pads_to_the_graph_size_and_feeds_pending_tokens():
    a = seq([1, 2, 3, 9], [3], 3, 1)
    b = seq([4, 5, 6, 7, 8, PENDING], [0, 6], 5, 1, row=4)  # its last token is being sampled in row 4
    inp = prepare_decode([a, b], BS, rows=4, table_width=3)
    assert inp.num_seqs == 2 and inp.input_ids.tolist() == [9, 0, 0, 0]  # the pending id is fed on the device
    assert inp.src.tolist() == [-1, 4, -1, -1]
    assert inp.positions.tolist() == [3, 5, 0, 0] and inp.context_lens.tolist() == [4, 6, 0, 0]
    assert inp.slot_mapping.tolist() == [15, 25, -1, -1]  # padding rows write nothing
    assert inp.block_tables.tolist() == [[3, -1, -1], [0, 6, -1], [-1, -1, -1], [-1, -1, -1]]
    plain = prepare_decode([a], BS, rows=1)
    assert plain.src is None and plain.block_tables.shape == (1, 1)
    assert prepare_decode([a], BS, rows=1, always_feed=True).src.tolist() == [-1]  # a feeding graph reads src


def test_decode_layout_is_one_set_of_disjoint_views():
    layout = DecodeLayout(max_seqs=3, max_blocks=2)
    buffer = torch.arange(layout.size, dtype=torch.int32)
    views = layout.views(buffer)
    assert list(views) == ["input_ids", "positions", "slot_mapping", "context_lens", "block_tables", "src"]
    assert views["block_tables"].shape == (3, 2)
    covered = np.concatenate([v.flatten().numpy() for v in views.values()]).tolist()
    assert len(set(covered)) == len(covered) == 3 * 5 + 3 * 2  # disjoint, in one buffer
    assert all(v.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for v in views.values())
    assert all(v.data_ptr() % 16 == 0 for v in views.values())  # 16-byte aligned starts (max_seqs 3 is odd)


@pytest.mark.parametrize("lengths", [[1], [3, 2], [5, 7, 1]])
def test_packed_step_arrays_start_16_byte_aligned(lengths):
    """Triton specialises a kernel on whether each pointer argument is 16-byte aligned: views at odd offsets
    of the upload buffer would compile a second variant of a kernel inside a later request."""
    buffers = InputBuffers(max_tokens=64, layout=DecodeLayout(max_seqs=3, max_blocks=4), device=torch.device("cpu"))
    seqs, next_block = [], 0
    for n in lengths:
        seq = Sequence(list(range(1, n + 1)))
        blocks = -(-n // BS)
        seq.block_table, seq.num_scheduled_tokens = list(range(next_block, next_block + blocks)), n
        next_block += blocks
        seqs.append(seq)
    inp = prepare_prefill(seqs, BS, keys_from_cache=True)
    views = buffers.upload_step(inp)
    assert set(views) >= {"input_ids", "positions", "slot_mapping", "context_lens", "cu_seqlens_q", "block_tables"}
    assert all(v.data_ptr() % 16 == 0 for v in views.values()), {k: v.data_ptr() % 16 for k, v in views.items()}
    for name, v in views.items():
        assert np.array_equal(v.numpy(), getattr(inp, name)), name
