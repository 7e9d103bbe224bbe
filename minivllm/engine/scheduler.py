"""Continuous batching with chunked prefill and preemption by recompute (nano-vllm's scheduler.py, extended).

Every sequence has `num_tokens` tokens of which `num_computed_tokens` have K/V in the cache; a step computes
the next `num_scheduled_tokens` of some sequences, under two budgets: `max_num_seqs` sequences and
`max_num_batched_tokens` tokens. A sequence samples its next token in the step that computes its last
token, so prefill, a later prefill chunk, decode and recompute after preemption are the same operation.

Order of one step: (1) running sequences that decode (1 token each) go first, so a long prompt being
prefilled never starves them; (2) running sequences still prefilling get chunks from the budget left;
(3) waiting sequences are admitted FIFO while budgets and free blocks allow, after a prefix-cache lookup.
When the KV cache is full, the newest running sequence is preempted: its blocks are freed, and it goes back
to the front of the queue to be recomputed later (its generated tokens are kept).

A sequence leaves through `finish`: on EOS / a stop token / its length (`on_result`), on a stop string (the
engine, which detokenises), or aborted. Its blocks are freed at once, even when a step that computes it is
still running: the GPU runs steps in order, so that step is done with the blocks before any later step
(whose schedule may reuse them) starts; its sampled token is discarded."""

from collections import deque

from minivllm.config import Config
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import PENDING, Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: Config, eos: list[int]) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos = set(eos)
        self.block_manager = BlockManager(
            config.num_kvcache_blocks, config.kvcache_block_size, config.enable_prefix_caching
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.finishing: list[Sequence] = []  # their last token is being sampled; nothing more to schedule
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.finishing

    def add(self, seq: Sequence, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """`seq` is done ("stop", "length" or "abort"): drop the placeholders of tokens still being sampled,
        free its blocks, and take it out of every queue."""
        end = seq.num_known_tokens
        del seq.token_ids[end:]
        seq.num_tokens = end
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        self.block_manager.deallocate(seq)
        for queue in (self.running, self.finishing, self.waiting):
            if seq in queue:
                queue.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _fit(self, seq: Sequence, budget: int) -> int:
        """Give `seq` up to `budget` tokens and their blocks, preempting the newest other sequences if the
        cache is full. Returns the tokens scheduled (0 if `seq` itself had to be preempted)."""
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        while not self.block_manager.can_grow(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return 0
        self.block_manager.grow(seq, seq.num_computed_tokens + n)
        seq.num_scheduled_tokens = n
        return n

    def schedule(self) -> list[Sequence]:
        budget = self.max_num_batched_tokens
        num_preemptions = self.num_preemptions
        scheduled: list[Sequence] = []
        decoding = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted for an earlier sequence this step
                continue
            n = self._fit(seq, budget)
            if n:
                budget -= n
                scheduled.append(seq)
        scheduled = [s for s in scheduled if s.status == SequenceStatus.RUNNING]
        if self.num_preemptions > num_preemptions:  # the cache is full: admit no one this step
            return scheduled  # (vLLM's rule; else a preempted prefill thrashes)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.token_ids[-1] == PENDING:  # preempted while its token was in flight
                break
            self.block_manager.allocate_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.can_grow(seq, seq.num_computed_tokens + n):
                self.block_manager.num_prefix_hits -= len(seq.block_table)  # not reused after all
                self.block_manager.deallocate(seq)  # wait until blocks free up
                break
            self.block_manager.grow(seq, seq.num_computed_tokens + n)
            seq.num_scheduled_tokens = n
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
            budget -= n
        return scheduled

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """nano-vllm's postprocess: account a step that has run, append its tokens (one per sequence of `seqs`) and
        finish sequences; returns those that finished. The engine calls its two halves apart, `on_launch` when it
        launches a step and `on_result` when the step's tokens arrive, so that it can run one step ahead."""
        return self.on_result(seqs, self.on_launch(seqs), token_ids)

    def on_launch(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """A step was launched: its tokens count as computed. Each sequence that reached its last token gets a
        PENDING placeholder for the token being sampled, so the next step can be scheduled before that token
        is known (the GPU feeds it in). One that will surely stop on length leaves the running list now.
        Returns (sequence, placeholder position) for on_result."""
        sampled = []
        for seq in seqs:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if seq.num_computed_tokens < seq.num_tokens:  # a prefill chunk: no token sampled yet
                continue
            sampled.append((seq, seq.num_tokens))
            seq.append_token(PENDING)
            if seq.num_completion_tokens >= seq.sampling_params.max_tokens or seq.num_tokens >= self.max_model_len:
                self.running.remove(seq)  # done after this token: never schedule again
                self.finishing.append(seq)
        return sampled

    def on_result(
        self, seqs: list[Sequence], sampled: list[tuple[Sequence, int]], token_ids: list[int]
    ) -> list[Sequence]:
        """The step's sampled tokens (one per row of `seqs`) arrived: fill the placeholders, finish sequences
        on EOS / stop tokens / length. Returns the sequences that finished."""
        rows = {id(s): i for i, s in enumerate(seqs)}
        finished = []
        for seq, pos in sampled:
            if seq.is_finished:  # stopped at an earlier token: discard this one
                continue
            token_id = token_ids[rows[id(seq)]]
            seq.token_ids[pos] = token_id
            if pos == seq.num_tokens - 1:
                seq.last_token = token_id
            self.block_manager.register_computed(seq)
            sp = seq.sampling_params
            num_output, reason = pos + 1 - seq.num_prompt_tokens, None
            if num_output >= sp.min_tokens and not sp.ignore_eos and token_id in self.eos:
                reason = "stop"
            elif num_output >= sp.min_tokens and token_id in sp.stop_token_ids:
                seq.stop_reason, reason = token_id, "stop"
            elif num_output >= sp.max_tokens or pos + 1 >= self.max_model_len:
                reason = "length"
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished
