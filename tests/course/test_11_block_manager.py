"""Chapter 11: the block manager (minivllm/engine/block_manager.py): chained hashes, blocks taken and freed with
reference counts, prefix hits confirmed token for token and never on a sequence's last token, growth by the
blocks a step needs (never a negative count), and every block back in the free list at the end."""

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence

BS = 4


def seq(tokens: list[int]) -> Sequence:
    return Sequence(list(tokens))


def compute(bm: BlockManager, s: Sequence, n: int) -> None:
    """What a step does: blocks for the first n tokens, their K/V computed, full blocks registered."""
    bm.grow(s, n)
    want = (n + BS - 1) // BS
    assert len(s.block_table) == want, (
        f"BlockManager.grow: {n} tokens need {want} blocks, the table has {s.block_table}"
    )
    s.num_computed_tokens = n
    bm.register_computed(s)


def test_compute_hash_chains():
    h = BlockManager.compute_hash
    a = h([1, 2, 3, 4])
    assert a == h([1, 2, 3, 4]), "BlockManager.compute_hash: the same tokens must hash the same"
    assert h([5, 6, 7, 8], a) != h([5, 6, 7, 8]), (
        "BlockManager.compute_hash: a block's hash must depend on the hash before it (equal hashes = equal prefixes)"
    )
    assert h([1, 2, 3, 4], a) != h([1, 2, 3, 5], a), "BlockManager.compute_hash: different tokens, same hash"


def test_allocate_grow_free():
    bm = BlockManager(num_blocks=9, block_size=BS)
    s = seq(range(10))
    assert bm.allocate_prefix(s) == 0, "BlockManager.allocate_prefix: an empty cache has no prefix to reuse"
    compute(bm, s, 10)
    assert len(s.block_table) == 3, f"BlockManager.grow: 10 tokens need 3 blocks of {BS}, got {s.block_table}"
    assert bm.num_free_blocks == 6, f"BlockManager._take: 3 of 9 blocks used, {bm.num_free_blocks} free (want 6)"
    assert bm.used_block_ids == set(s.block_table), (
        f"BlockManager._take: used blocks {sorted(bm.used_block_ids)}, the table holds {s.block_table}"
    )
    h0 = BlockManager.compute_hash(s.token_ids[:BS])
    hashes = [bm.blocks[b].hash for b in s.block_table[:2]]
    assert hashes == [h0, BlockManager.compute_hash(s.token_ids[BS : 2 * BS], h0)], (
        "BlockManager.register_computed: the full blocks' hashes must chain (block 1's on block 0's)"
    )
    assert bm.num_blocks_needed(s, 5) == 0, (
        f"BlockManager.num_blocks_needed: a sequence that holds 3 blocks needs 0 more for 5 tokens, "
        f"got {bm.num_blocks_needed(s, 5)} (max(0, .))"
    )
    assert bm.num_blocks_needed(s, 13) == 1, "BlockManager.num_blocks_needed: 13 tokens in 4-token blocks need 4"
    assert bm.can_grow(s, 36) and not bm.can_grow(s, 37), (
        "BlockManager.can_grow: 6 free blocks: 36 tokens (6 more blocks) fit, 37 do not"
    )
    assert s.num_hashed_blocks == 2, f"BlockManager.register_computed: 2 full blocks, {s.num_hashed_blocks} hashed"
    bm.deallocate(s)
    assert bm.num_free_blocks == 9 and not bm.used_block_ids, (
        f"BlockManager.deallocate: every block must be free again, {bm.num_free_blocks} of 9 are"
    )
    assert s.block_table == [] and s.num_computed_tokens == 0, "BlockManager.deallocate: the sequence keeps blocks"


def test_prefix_hits_and_reference_counts():
    bm = BlockManager(num_blocks=12, block_size=BS)
    prompt = list(range(100, 111))  # 11 tokens: two full blocks and three more
    a = seq(prompt)
    bm.allocate_prefix(a)
    compute(bm, a, len(prompt))
    b = seq(prompt[:8] + [7, 7, 7])  # shares the two full blocks
    hit = bm.allocate_prefix(b)
    assert hit == 8, f"BlockManager.allocate_prefix: b shares a's first 2 blocks (8 tokens), reused {hit}"
    assert b.block_table == a.block_table[:2], (
        f"BlockManager.allocate_prefix: b's table {b.block_table} must start with a's blocks {a.block_table[:2]}"
    )
    for block_id in a.block_table[:2]:
        assert bm.blocks[block_id].ref_count == 2, (
            f"BlockManager.allocate_prefix: block {block_id} is shared by two sequences, "
            f"ref_count {bm.blocks[block_id].ref_count}"
        )
    c = seq(prompt[:8])  # 8 tokens = exactly two blocks: the last token must still be computed
    assert bm.allocate_prefix(c) == 4, (
        "BlockManager.allocate_prefix: a prompt of exactly 2 blocks reuses only the first (its last token is "
        f"always computed, for its logits), reused {c.num_cached_tokens}"
    )
    d = seq([999] + prompt[1:8] + [5])  # different first token: different chain, no hit
    assert bm.allocate_prefix(d) == 0, "BlockManager.allocate_prefix: a different first block must not hit"
    for s in (a, b, c, d):
        bm.deallocate(s)
    assert bm.num_free_blocks == 12, f"BlockManager.deallocate: {12 - bm.num_free_blocks} blocks leaked"
    e = seq(prompt)  # after everything was freed, the cached blocks are still there to hit
    assert bm.allocate_prefix(e) == 8, "BlockManager.deallocate: a freed block keeps its hash until reused"
    bm.deallocate(e)


def test_reallocated_block_forgets_its_hash():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq(list(range(9)))  # blocks 0, 1, 2; the first two hashed
    bm.allocate_prefix(a)
    compute(bm, a, 9)
    bm.deallocate(a)
    b = seq(list(range(50, 63)))  # 13 tokens: every block, a's contents overwritten
    bm.allocate_prefix(b)
    compute(bm, b, 13)
    bm.deallocate(b)
    x = seq([77])  # takes the oldest free block, so that c's blocks are others than a's were
    bm.allocate_prefix(x)
    bm.grow(x, 1)
    c = seq(list(range(9)))  # a's prompt again: no hit (b overwrote it), computed anew and registered
    assert bm.allocate_prefix(c) == 0, "BlockManager._allocate_fresh: a's blocks were overwritten by b's, yet hit"
    compute(bm, c, 9)
    bm.deallocate(c)
    d = seq(list(range(9)))
    hit = bm.allocate_prefix(d)
    assert hit == 8, (
        f"BlockManager._allocate_fresh: c registered a's prompt anew, yet d hit {hit} of 8 tokens: a reallocated "
        "block must leave the hash table (else its stale entry keeps the new block out)"
    )
    for s in (d, x):
        bm.deallocate(s)
