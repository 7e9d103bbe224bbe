"""Plausible wrong answers, one or more per exercise of notebooks/exercises.toml: tests/test_course_edition.py
plants each in a copy of the package and requires its chapter's checks to fail with a message naming the exercise.
Each is the body that replaces the reference's (signature and docstring kept)."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Wrong:
    qualname: str  # as in notebooks/exercises.toml
    body: str  # the wrong body; or, with `edit`, empty: the reference's body with the edits made
    why: str  # the mistake, in words
    edit: tuple[tuple[str, str], ...] = ()  # (old, new) replacements in the reference's body, each found once

    def wrong_body(self, reference: str) -> str:
        if not self.edit:
            return self.body
        for old, new in self.edit:
            if reference.count(old) != 1:
                raise ValueError(f"{self.qualname}: {old!r} is in the reference's body {reference.count(old)} times")
            reference = reference.replace(old, new)
        return reference


WRONG = [
    # --- 01 ----------------------------------------------------------------------------------------------------
    Wrong(
        "rms_norm",
        """
        var = x.pow(2).mean(dim=-1, keepdim=True)
        return (x * torch.rsqrt(var + eps)).to(out_dtype or x.dtype) * weight
        """,
        "no fp32 upcast: the variance and the scaling run in bf16",
    ),
    Wrong(
        "rms_norm",
        """
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True))).to(out_dtype or x.dtype) * weight
        """,
        "eps left out",
    ),
    Wrong(
        "add_rms_norm",
        """
        s = x + residual
        return rms_norm(s, weight, eps), s
        """,
        "the residual add in bf16 (no fp32 upcast)",
    ),
    Wrong(
        "add_rms_norm",
        """
        s = x.float() + residual.float()
        return rms_norm(s, weight, eps, x.dtype), residual
        """,
        "returns the old residual, not the sum",
    ),
    Wrong(
        "RMSNorm.forward",
        """
        if residual is None:
            return self._rms_norm(x, self.weight, self.eps)
        return self._add_rms_norm(residual, x, self.weight, self.eps)[::-1]
        """,
        "the two outputs of the fused path swapped",
    ),
    # --- 02 ----------------------------------------------------------------------------------------------------
    Wrong(
        "apply_rotary_emb",
        """
        x1, x2 = torch.chunk(x, 2, dim=-1)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        """,
        "no fp32 upcast: the products and sums round in bf16",
    ),
    Wrong(
        "apply_rotary_emb",
        """
        x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return torch.stack((y1, y2), dim=-1).flatten(-2).to(x.dtype)
        """,
        "GPT-J's interleaved pairs instead of neox's halves",
    ),
    Wrong(
        "rotary",
        """
        cos, sin = cos_sin_cache[: query.shape[0]].chunk(2, dim=-1)
        return apply_rotary_emb(query, cos, sin), apply_rotary_emb(key, cos, sin)
        """,
        "positions ignored (token i taken to sit at position i)",
    ),
    Wrong(
        "RotaryEmbedding.__init__",
        """
        super().__init__()
        self.head_size = head_size
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, dtype=torch.float) / rotary_dim))[: rotary_dim // 2]
        t = torch.arange(max_position_embeddings, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache.unsqueeze_(1), persistent=False)
        self._rotary = ops.bind(ops.rotary, rotary, token_args=3)
        """,
        "frequencies base^(-i/d) instead of base^(-2i/d)",
    ),
    # --- 03 ----------------------------------------------------------------------------------------------------
    Wrong(
        "silu_and_mul",
        """
        up, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * up
        """,
        "gate and up halves swapped",
    ),
    Wrong("SiluAndMul.forward", "return F.silu(x[..., : x.shape[-1] // 2])", "the up half dropped"),
]
WRONG += [
    # --- 04 ----------------------------------------------------------------------------------------------------
    Wrong(
        "ColumnParallelLinear.weight_loader",
        """
        shard_size = param.data.size(self.tp_dim)
        param.data.copy_(loaded_weight.narrow(self.tp_dim, 0, shard_size))
        """,
        "every rank loads the first shard",
    ),
    Wrong(
        "MergedColumnParallelLinear.weight_loader",
        """
        shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
        param_data = param.data.narrow(self.tp_dim, loaded_shard_id * shard_size, shard_size)
        param_data.copy_(loaded_weight.chunk(self.tp_size, self.tp_dim)[self.tp_rank])
        """,
        "offset from the shard id times this shard's size (wrong when gate and up differ)",
    ),
    Wrong(
        "QKVParallelLinear.weight_loader",
        """
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[loaded_shard_id]
        param.data.narrow(self.tp_dim, offset, size).copy_(loaded_weight.narrow(self.tp_dim, 0, size))
        """,
        "every rank takes the first heads",
    ),
    Wrong(
        "RowParallelLinear.weight_loader",
        """
        if param.data.dim() == 2:
            shard_size = param.data.size(0)
            loaded_weight = loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size)
        param.data.copy_(loaded_weight[:, : param.shape[1]] if param.data.dim() == 2 else loaded_weight)
        """,
        "shards the output dim (a column layer's) instead of the input dim",
    ),
    Wrong("LinearBase.forward", "return self._linear(x, self.weight, None, self.packed_weight)", "bias left out"),
    Wrong(
        "RowParallelLinear.forward",
        """
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"RowParallelLinear: input last dim {x.shape[-1]} != {self.weight.shape[1]}")
        y = self._linear(x, self.weight, self.bias, self.packed_weight)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.group)
        return y
        """,
        "the bias added on every rank (the all_reduce sums it tp times)",
    ),
    # --- 05 ----------------------------------------------------------------------------------------------------
    Wrong(
        "VocabParallelEmbedding.weight_loader",
        """
        shard_size = param.data.size(0)
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size))
        """,
        "no check of the checkpoint's vocabulary (a longer one is cut silently)",
    ),
    Wrong(
        "VocabParallelEmbedding.forward",
        """
        if self.tp_size > 1:
            x = (x - self.vocab_start_idx).clamp(0, self.num_embeddings_per_partition - 1)
        y = F.embedding(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.group)
        return y
        """,
        "clamps foreign ids instead of masking their rows: the all_reduce adds other ranks' rows",
    ),
    Wrong(
        "ParallelLMHead.forward",
        """
        context = get_context()
        if context.is_prefill:
            x = x[context.cu_seqlens_q[:-1]].contiguous()
        return self.project(x)
        """,
        "the first token of each sequence, not the last",
    ),
    Wrong(
        "ParallelLMHead.project",
        """
        logits = self._linear(x, self.weight, None, self.packed_weight)
        if self.tp_size > 1:
            dist.all_reduce(logits, group=self.group)
        return logits
        """,
        "all_reduce of the vocabulary shards (sums logits of different tokens) instead of a gather",
    ),
]

WRONG += [
    # --- 06 ----------------------------------------------------------------------------------------------------
    Wrong(
        "store_kvcache_kernel",
        "",
        "rows read as if contiguous (token i at i * D), not at the row stride of the fused qkv",
        edit=(("idx * key_stride", "idx * D"), ("idx * value_stride", "idx * D")),
    ),
    Wrong(
        "store_kvcache",
        "",
        "the launch passes D as the row stride (assumes contiguous K/V)",
        edit=(("key.stride(0),", "D,"), ("value.stride(0),", "D,")),
    ),
    Wrong(
        "store_kvcache_torch",
        """
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping.long()] = key
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping.long()] = value
        """,
        "padding slots (-1) not skipped: they overwrite the cache's last slot",
    ),
    # --- 07 ----------------------------------------------------------------------------------------------------
    Wrong(
        "causal_mask",
        "",
        "aligned top-left (query i sees keys 0..i) instead of bottom-right",
        edit=(("j <= i + (k_len - q_len)", "j <= i"),),
    ),
    Wrong(
        "gather_paged",
        "return cache.flatten(0, 1)[:length]",
        "the cache read in order, the block table ignored",
    ),
    Wrong(
        "decode_gather",
        "",
        "key j of every sequence taken from slot j (the block tables ignored)",
        edit=(
            (
                "tables[:, pos // block_size] * block_size + pos % block_size",
                "pos[None, :].expand(tables.shape[0], -1)",
            ),
        ),
    ),
    Wrong(
        "varlen_attention",
        "return _sdpa(q[None], k[None], v[None], scale, causal=True)[0]",
        "the packed batch attended as one sequence (a sequence sees the ones before it)",
    ),
    Wrong(
        "paged_prefill_attention",
        "",
        "the cached prefix ignored: the queries attend to themselves only",
        edit=(
            (
                "mask = causal_mask(end - start, lens[i], q.device)",
                "mask = causal_mask(end - start, lens[i], q.device)\n    n = end - start\n"
                "    k, v, mask = k[-n:], v[-n:], causal_mask(n, n, q.device)",
            ),
        ),
    ),
    Wrong(
        "paged_decode_attention",
        "",
        "no mask: a sequence attends to keys past its context",
        edit=(("mask=g.mask", "mask=None"),),
    ),
    Wrong(
        "paged_decode_kernel",
        "",
        "online softmax without the running max: exp of raw scores (overflows fp32)",
        edit=(("m_new = tl.maximum(m, tl.max(s, axis=1))", "m_new = tl.zeros((BLOCK_G,), tl.float32)"),),
    ),
    Wrong(
        "paged_decode_kernel",
        "",
        "the running sum not rescaled when the max grows",
        edit=(("l = l * alpha + tl.sum(p, axis=1)", "l = l + tl.sum(p, axis=1)"),),
    ),
    Wrong(
        "combine_splits_kernel",
        "",
        "splits averaged with equal weights instead of by their log-sum-exp",
        edit=(
            (
                'w = tl.where(lse > -float("inf"), tl.exp2(lse - top), 0.0)',
                'w = tl.where(lse > -float("inf"), 1.0, 0.0)',
            ),
        ),
    ),
]

WRONG += [
    # --- 08 ----------------------------------------------------------------------------------------------------
    Wrong(
        "Attention.forward",
        "return self.backend.attend(q, k, v, self.k_cache, self.v_cache, get_context(), self.scale)",
        "the new K/V never stored: later steps read an empty cache",
    ),
    Wrong(
        "AttentionBackend.attend",
        """
        if context.is_prefill:
            return self.prefill(q, k, v, context.cu_seqlens_q, context.max_seqlen_q, scale)
        return self.decode(q, k_cache, v_cache, context.context_lens, self.tables(context), scale)
        """,
        "a prefill always over the fresh K/V: a later chunk does not see its cached prefix",
    ),
    Wrong(
        "AttentionBackend.attend_paged",
        "",
        "the decode rows left out of the result",
        edit=(("return torch.cat([decoded, out]) if d else out", "return out"),),
    ),
    # --- 09 ----------------------------------------------------------------------------------------------------
    Wrong(
        "exponential_race",
        """
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs).exponential_(1, generator=generator)
        return (probs / noise).argmax(dim=-1)
        """,
        "temperature ignored (and temperature 0 not greedy)",
    ),
    Wrong(
        "exponential_race",
        "",
        "argmax(p * E) instead of argmax(p / E)",
        edit=(("sampled = (probs / noise).argmax(dim=-1)", "sampled = (probs * noise).argmax(dim=-1)"),),
    ),
    Wrong(
        "Sampler.forward",
        """
        if temperatures is None:
            return logits.float().argmax(dim=-1)
        return exponential_race(logits.float(), temperatures)
        """,
        "noise from torch's global generator, not the sampler's own (two engines shift each other's draws)",
    ),
]

WRONG += [
    # --- 10 ----------------------------------------------------------------------------------------------------
    Wrong(
        "Qwen3Attention.forward",
        "",
        "RoPE before the per-head QK-norm",
        edit=(
            ("if self.qk_norm:  # per-head", "q, k = self.rotary_emb(positions, q, k)\nif self.qk_norm:  # per-head"),
            ("q, k = self.rotary_emb(positions, q, k)\no = self.attn", "o = self.attn"),
        ),
    ),
    Wrong(
        "Qwen3MLP.forward",
        "return self.down_proj(self.gate_up_proj(x)[..., : self.down_proj.weight.shape[1]])",
        "the activation left out",
    ),
    Wrong(
        "Qwen3DecoderLayer.forward",
        "",
        "the MLP's input not normalised (post_attention_layernorm skipped)",
        edit=(
            (
                "hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)",
                "hidden_states, residual = hidden_states + residual, hidden_states + residual",
            ),
        ),
    ),
    Wrong(
        "Qwen3Model.forward",
        "",
        "the final norm without the last residual",
        edit=(("hidden_states, _ = self.norm(hidden_states, residual)", "hidden_states = self.norm(hidden_states)"),),
    ),
    # --- 11 ----------------------------------------------------------------------------------------------------
    Wrong(
        "BlockManager.compute_hash",
        """
        h = xxhash.xxh64()
        h.update(np.array(token_ids, dtype=np.int64).tobytes())
        return h.intdigest()
        """,
        "the prefix hash not chained in",
    ),
    Wrong(
        "BlockManager._take",
        """
        block = self.blocks[block_id]
        del self.free_block_ids[block_id]
        block.ref_count = 1
        return block
        """,
        "a taken block not marked used: a prefix hit on it bumps nothing",
    ),
    Wrong(
        "BlockManager._allocate_fresh",
        """
        block = self._take(next(iter(self.free_block_ids)))
        block.hash, block.token_ids = -1, []
        return block.block_id
        """,
        "a reallocated block stays in the hash table",
    ),
    Wrong(
        "BlockManager.allocate_prefix",
        "",
        "the last token matched too (a full-prompt hit leaves nothing to compute)",
        edit=(("range((seq.num_tokens - 1) // self.block_size)", "range(seq.num_tokens // self.block_size)"),),
    ),
    Wrong(
        "BlockManager.num_blocks_needed",
        "return (num_tokens + self.block_size - 1) // self.block_size - len(seq.block_table)",
        "no max(0, .): a sequence holding more blocks than needed gets a negative count",
    ),
    Wrong(
        "BlockManager.can_grow",
        "return self.num_blocks_needed(seq, num_tokens) < self.num_free_blocks",
        "off by one: the last free block is never granted",
    ),
    Wrong(
        "BlockManager.grow",
        "seq.block_table.append(self._allocate_fresh())",
        "one block per call, whatever the step needs",
    ),
    Wrong(
        "BlockManager.register_computed",
        "",
        "every block hashed alone, not chained on the one before",
        edit=(("prefix = self.blocks[seq.block_table[i - 1]].hash if i > 0 else -1", "prefix = -1"),),
    ),
    Wrong(
        "BlockManager.deallocate",
        "",
        "freed blocks not returned to the free list",
        edit=(("self.free_block_ids[block_id] = None  # newest free, reused last", "pass"),),
    ),
    # --- 12 ----------------------------------------------------------------------------------------------------
    Wrong(
        "Scheduler.finish",
        "",
        "a finished sequence keeps its blocks",
        edit=(("self.block_manager.deallocate(seq)\n", ""),),
    ),
    Wrong(
        "Scheduler.add",
        "self.waiting.append(seq)",
        "front ignored: a sequence that must go first (a request's later samples) waits behind newer requests",
    ),
    Wrong(
        "Scheduler.preempt",
        "",
        "the victim goes to the back of the queue (FIFO order lost, it waits behind newer requests)",
        edit=(("self.waiting.appendleft(seq)", "self.waiting.append(seq)"),),
    ),
    Wrong(
        "Scheduler._fit",
        "",
        "the oldest running sequence preempted instead of the newest",
        edit=(("victim = self.running[-1]", "victim = self.running[0]"),),
    ),
    Wrong(
        "Scheduler.schedule",
        "",
        "prefill chunks scheduled before decodes",
        edit=(("for seq in decoding + prefilling:", "for seq in prefilling + decoding:"),),
    ),
    Wrong(
        "Scheduler.schedule",
        "",
        "a waiting prompt admitted whole, over the token budget",
        edit=(
            (
                "    n = min(seq.num_tokens - seq.num_computed_tokens, budget)\n    if not self",
                "    n = seq.num_tokens - seq.num_computed_tokens\n    if not self",
            ),
        ),
    ),
    Wrong(
        "Scheduler.on_launch",
        "",
        "a prefill chunk samples a token too",
        edit=(
            (
                "if seq.num_computed_tokens < seq.num_tokens:  # a prefill chunk: no token sampled yet",
                "if seq.num_computed_tokens < seq.num_tokens - 100:",
            ),
        ),
    ),
    Wrong(
        "Scheduler.on_result",
        "",
        "EOS ignored",
        edit=(("and token_id in self.eos:", "and token_id in ():"),),
    ),
    # --- 13 ----------------------------------------------------------------------------------------------------
    Wrong(
        "token_slots",
        """
        pos = np.arange(end - start)
        table = np.asarray(block_table, dtype=np.int64)
        return table[pos // block_size] * block_size + pos % block_size
        """,
        "start ignored: positions counted from 0",
    ),
    Wrong(
        "block_tables_of",
        "",
        "padded with 0 (a real block) instead of -1",
        edit=(("np.full((rows, width), -1, dtype=np.int32)", "np.zeros((rows, width), dtype=np.int32)"),),
    ),
    Wrong(
        "pending_sources",
        "",
        "pending ids left in place (not set to 0)",
        edit=(("input_ids[pending] = 0\n", ""),),
    ),
    Wrong(
        "prepare_prefill",
        "",
        "context lengths counted as the new tokens only",
        edit=(("context_lens=ends.astype(np.int32)", "context_lens=(ends - starts).astype(np.int32)"),),
    ),
    Wrong(
        "prepare_decode",
        "",
        "the position of the next token, not the last one",
        edit=(("p = s.num_tokens - 1", "p = s.num_tokens"),),
    ),
]

WRONG += [
    # --- 14 ----------------------------------------------------------------------------------------------------
    Wrong(
        "LLMEngine.step",
        "",
        "returns only the failed requests' outputs: the tokens read back are lost",
        edit=(("return outputs + failed", "return failed"),),
    ),
    Wrong(
        "LLMEngine.step",
        "",
        "the step in flight read back before the launch, always: the outputs come one step late and the last is lost",
        edit=(
            (
                "if self.in_flight is not None:\n    outputs += self._finish(self.in_flight)\n    progressed = True\n",
                "",
            ),
        ),
    ),
    Wrong(
        "LLMEngine.add_request",
        "",
        "the request recorded but never handed to the scheduler",
        edit=(("    self.schedule(request)", "    pass"),),
    ),
    Wrong(
        "LLMEngine.schedule",
        "pass",
        "a request's sequences never handed to the scheduler",
    ),
    Wrong(
        "LLMEngine._launch",
        "",
        "the scheduler not told of the launch (on_launch skipped): no token is ever expected",
        edit=(("sampled = self.scheduler.on_launch(seqs)", "sampled = []"),),
    ),
    Wrong(
        "LLMEngine._finish",
        "",
        "reports the token before the one sampled",
        edit=(("request.output(seq, pos, logprobs", "request.output(seq, pos - 1, logprobs"),),
    ),
    Wrong(
        "EngineRequest.output",
        "",
        "the token before the one at pos",
        edit=(("[seq.token_ids[pos]]", "[seq.token_ids[pos - 1]]"),),
    ),
]
