"""Paged KV blocks with reference counts and prefix caching (nano-vllm's block_manager.py).

A full block is identified by a chained hash of its tokens and the hash of the block before it, so equal
hashes mean equal prefixes. A block is registered in the prefix cache only once its K/V have been computed;
a freed block keeps its hash and contents until it is reallocated, so a later request can still hit it.
Hits are confirmed token for token against collisions, and the last token of a sequence is never matched,
so at least one token is always computed (its logits give the next token)."""

import numpy as np
import xxhash

from minivllm.engine.sequence import PENDING, Sequence


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: dict[int, None] = dict.fromkeys(range(num_blocks))  # an ordered set, oldest first
        self.used_block_ids: set[int] = set()
        self.num_prefix_hits = 0  # blocks reused from the prefix cache, for tests and stats

    @staticmethod
    def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.array(token_ids, dtype=np.int64).tobytes())
        return h.intdigest()

    def block_tokens(self, seq: Sequence, i: int) -> list[int]:
        """The tokens of `seq` that block i of its table holds."""
        return seq.token_ids[i * self.block_size : (i + 1) * self.block_size]

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _take(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        del self.free_block_ids[block_id]
        self.used_block_ids.add(block_id)
        block.ref_count = 1
        return block

    def _allocate_fresh(self) -> int:
        block = self._take(next(iter(self.free_block_ids)))  # the oldest free block
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]  # its old contents are gone now
        block.hash, block.token_ids = -1, []
        return block.block_id

    def allocate_prefix(self, seq: Sequence) -> int:
        """On admission: reuse cached blocks for the longest matching prefix. Returns tokens reused."""
        assert not seq.block_table, "allocate_prefix is for a sequence that holds no blocks"
        h = -1
        if self.enable_prefix_caching and seq.sampling_params.prompt_logprobs is None:  # those score every position
            for i in range((seq.num_tokens - 1) // self.block_size):  # full blocks, never the last token
                token_ids = self.block_tokens(seq, i)
                h = self.compute_hash(token_ids, h)
                block_id = self.hash_to_block_id.get(h, -1)
                if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                    break
                if block_id in self.used_block_ids:
                    self.blocks[block_id].ref_count += 1
                else:
                    self._take(block_id)
                seq.block_table.append(block_id)
                self.num_prefix_hits += 1
        seq.num_hashed_blocks = len(seq.block_table)
        seq.num_cached_tokens = seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_cached_tokens

    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        return max(0, (num_tokens + self.block_size - 1) // self.block_size - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.num_blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._allocate_fresh())

    def register_computed(self, seq: Sequence) -> None:
        """After a step: put every newly completed full block of `seq` into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        while seq.num_hashed_blocks < seq.num_computed_tokens // self.block_size:
            i = seq.num_hashed_blocks
            block = self.blocks[seq.block_table[i]]
            prefix = self.blocks[seq.block_table[i - 1]].hash if i > 0 else -1
            token_ids = self.block_tokens(seq, i)
            if PENDING in token_ids:  # not every token known yet
                break
            block.hash, block.token_ids = self.compute_hash(token_ids, prefix), token_ids
            self.hash_to_block_id.setdefault(block.hash, block.block_id)
            seq.num_hashed_blocks += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache: benchmarks start cold). Only when no block is in use: a
        running sequence chains its next blocks' hashes on its registered ones. Returns whether it reset."""
        if self.used_block_ids:
            return False
        self.hash_to_block_id.clear()
        for block in self.blocks:
            block.hash, block.token_ids = -1, []
        return True

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids[block_id] = None  # newest free, reused last
        seq.block_table.clear()
        seq.num_cached_tokens = seq.num_computed_tokens = seq.num_hashed_blocks = 0
