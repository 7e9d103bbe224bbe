"""The paged KV block manager (minivllm/engine/block_manager.py), driven directly with Sequence objects and
no model: a hypothesis state machine admits, computes, grows and frees random sequences over a small token
alphabet (so prefixes repeat) and checks after every step that no block leaks or is freed twice, that
reference counts equal the number of sequences holding each block, and that a prefix hit only ever returns
blocks whose K/V were computed from exactly the sequence's tokens (a shadow record of what was written to
every slot). Then the prefix cache's rules, one example each."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence


def check_accounting(bm: BlockManager, holders: list[Sequence]) -> None:
    """free + used = all blocks, disjoint; ref counts = sequences holding the block; hash map consistent."""
    n = len(bm.blocks)
    assert set(bm.free_block_ids).isdisjoint(bm.used_block_ids)
    assert len(bm.free_block_ids) + len(bm.used_block_ids) == n
    held = [0] * n
    for seq in holders:
        assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in one table"
        for b in seq.block_table:
            held[b] += 1
    for block in bm.blocks:
        assert block.ref_count == held[block.block_id], (
            f"block {block.block_id}: ref {block.ref_count}, held {held[block.block_id]}"
        )
        assert (block.block_id in bm.used_block_ids) == (block.ref_count > 0)
    for h, b in bm.hash_to_block_id.items():
        assert bm.blocks[b].hash == h and len(bm.blocks[b].token_ids) == bm.block_size


class Shadow:
    """What was written to each slot: the tokens its K/V were computed from (the whole prefix up to it)."""

    def __init__(self, block_size: int) -> None:
        self.bs, self.slots = block_size, {}

    def write(self, bm: BlockManager, seq: Sequence, start: int, end: int) -> None:
        for p in range(start, end):
            b = seq.block_table[p // self.bs]
            assert bm.blocks[b].ref_count == 1, f"writing into block {b} shared by {bm.blocks[b].ref_count} sequences"
            self.slots[b, p % self.bs] = tuple(seq.token_ids[: p + 1])

    def check_hit(self, seq: Sequence) -> None:
        assert seq.num_cached_tokens % self.bs == 0 and seq.num_cached_tokens < seq.num_tokens
        for p in range(seq.num_cached_tokens):
            b = seq.block_table[p // self.bs]
            assert self.slots.get((b, p % self.bs)) == tuple(seq.token_ids[: p + 1]), (
                f"prefix hit on block {b} with other contents"
            )


prefixes = st.lists(st.integers(1, 3), max_size=12)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        bs=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(1, 12),
        caching=st.booleans(),
        pool=st.lists(prefixes, min_size=1, max_size=3),
    )
    def setup(self, bs, num_blocks, caching, pool):
        self.bs, self.pool = bs, pool
        self.bm = BlockManager(num_blocks, bs, caching)
        self.shadow = Shadow(bs)
        self.seqs: list[Sequence] = []
        self.hits = 0

    @rule(which=st.integers(0, 2), suffix=st.lists(st.integers(1, 3), min_size=1, max_size=10))
    def admit(self, which, suffix):
        seq = Sequence(self.pool[which % len(self.pool)] + suffix)
        before = self.bm.num_prefix_hits
        cached = self.bm.allocate_prefix(seq)
        assert cached == seq.num_cached_tokens == seq.num_computed_tokens == len(seq.block_table) * self.bs
        assert self.bm.num_prefix_hits - before == len(seq.block_table)
        if not self.bm.enable_prefix_caching:
            assert cached == 0
        self.shadow.check_hit(seq)
        self.hits += len(seq.block_table)
        if self.bm.can_grow(seq, seq.num_computed_tokens + 1):
            self.bm.grow(seq, seq.num_computed_tokens + 1)
            self.seqs.append(seq)
        else:  # no room: give the hit blocks back
            self.bm.deallocate(seq)
            assert not seq.block_table

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), n=st.integers(1, 9))
    def compute(self, i, n):
        """Compute up to n more tokens of one sequence (allocating their blocks), then register them."""
        seq = self.seqs[i % len(self.seqs)]
        n = min(n, seq.num_tokens - seq.num_computed_tokens)
        if n == 0 or not self.bm.can_grow(seq, seq.num_computed_tokens + n):
            return
        self.bm.grow(seq, seq.num_computed_tokens + n)
        assert len(seq.block_table) == (seq.num_computed_tokens + n + self.bs - 1) // self.bs
        self.shadow.write(self.bm, seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        self.bm.register_computed(seq)
        assert seq.num_hashed_blocks == (seq.num_computed_tokens // self.bs if self.bm.enable_prefix_caching else 0)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), token=st.integers(1, 3))
    def append(self, i, token):
        """A sampled token: only once every token so far is computed."""
        seq = self.seqs[i % len(self.seqs)]
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(token)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        seq = self.seqs.pop(i % len(self.seqs))
        self.bm.deallocate(seq)
        assert not seq.block_table and seq.num_computed_tokens == 0

    @invariant()
    def accounting(self):
        if hasattr(self, "bm"):
            check_accounting(self.bm, self.seqs)
            assert self.bm.num_prefix_hits == self.hits


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=250, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# --- the prefix cache's rules, one example each -------------------------------------------------------------


def computed(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence admitted, fully computed and registered."""
    seq = Sequence(tokens)
    bm.allocate_prefix(seq)
    bm.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed(seq)
    return seq


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(8, 4)
    a = computed(bm, list(range(1, 11)))  # 10 tokens: 2 full blocks + 2 tokens
    b = Sequence(list(range(1, 9)) + [42, 43])  # same first 8 tokens
    assert bm.allocate_prefix(b) == 8 and b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.grow(b, b.num_tokens)
    assert b.block_table[2] not in a.block_table and bm.num_free_blocks == 4
    check_accounting(bm, [a, b])


def test_the_last_token_is_never_matched():
    bm = BlockManager(8, 4)
    a = computed(bm, list(range(1, 9)))  # exactly 2 full blocks, both registered
    assert a.num_hashed_blocks == 2
    b = Sequence(list(range(1, 9)))
    assert bm.allocate_prefix(b) == 4  # block 1 holds b's last token: recomputed
    assert bm.num_prefix_hits == 1


def test_blocks_are_registered_only_after_their_kv_is_computed():
    bm = BlockManager(8, 4)
    a = Sequence(list(range(1, 11)))
    bm.allocate_prefix(a)
    bm.grow(a, 10)  # allocated, nothing computed yet
    a.num_computed_tokens = 5
    bm.register_computed(a)  # only block 0 is complete
    assert a.num_hashed_blocks == 1
    assert bm.allocate_prefix(Sequence(list(range(1, 11)))) == 4


def test_freed_blocks_keep_their_hash_until_reallocated():
    bm = BlockManager(4, 4)
    a = computed(bm, list(range(1, 10)))  # 3 blocks
    bm.deallocate(a)
    assert bm.num_free_blocks == 4
    b = Sequence(list(range(1, 10)))
    assert bm.allocate_prefix(b) == 8  # freed, still cached: a hit
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table)
    bm.deallocate(b)
    c = computed(bm, [7] * 16)  # takes all 4 blocks: old contents gone
    bm.deallocate(c)
    assert bm.allocate_prefix(Sequence(list(range(1, 10)))) == 0
    assert bm.allocate_prefix(Sequence([7] * 16 + [1])) == 16


def test_the_oldest_free_block_is_reused_first():
    """Eviction order: a freed block keeps its K/V for the prefix cache until it is reused, the oldest free
    block first. Blocks freed earlier go before blocks freed later, and a freed sequence's blocks go from its
    last to its first, so its first blocks, the prefix other requests share, are evicted last."""
    bm = BlockManager(8, 4)
    a = computed(bm, list(range(1, 14)))  # 13 tokens: blocks 0-3, the three full ones cached
    c = computed(bm, list(range(21, 34)))  # blocks 4-7
    bm.deallocate(a)  # free, oldest first: 3 2 1 0
    bm.deallocate(c)  # then 7 6 5 4
    d = computed(bm, [9] * 8)  # two blocks: a's last two (its partial tail, then its third full block)
    assert d.block_table == [3, 2]
    assert bm.allocate_prefix(Sequence(list(range(21, 34)))) == 12  # c, freed later: all of it still cached
    assert bm.allocate_prefix(Sequence(list(range(1, 14)))) == 8  # a: its first two blocks


def test_a_hash_collision_is_caught_by_the_token_check(monkeypatch):
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(lambda token_ids, prefix=-1: 12345))
    bm = BlockManager(8, 4)
    computed(bm, [1, 2, 3, 4, 5])
    assert bm.allocate_prefix(Sequence([9, 9, 9, 9, 5])) == 0  # same hash, other tokens: no hit
    assert bm.allocate_prefix(Sequence([1, 2, 3, 4, 6])) == 4


def test_caching_off_never_hits():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    computed(bm, [1, 2, 3, 4, 5])
    assert bm.allocate_prefix(Sequence([1, 2, 3, 4, 5])) == 0 and bm.num_prefix_hits == 0
    assert bm.hash_to_block_id == {}


@pytest.mark.parametrize("n, needed", [(0, 0), (1, 1), (4, 1), (5, 2), (9, 3)])
def test_num_blocks_needed(n, needed):
    bm = BlockManager(2, 4)
    seq = Sequence([1] * 9)
    assert bm.num_blocks_needed(seq, n) == needed
    assert bm.can_grow(seq, n) == (needed <= 2)
