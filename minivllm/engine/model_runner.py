"""Runs the model for one scheduled step (nano-vllm's model_runner.py): builds the step context, owns the
KV cache, samples on rank 0, and replays captured CUDA graphs for decode. Rank 0 also drives the
tensor-parallel workers: each step's inputs go to them over a pipe, and they run the same forward.

Host work per step is kept small (see ../shared/PERF-NOTES.md): inputs are built with numpy into one
persistent pinned buffer and reach the GPU in one copy; the decode graphs read their inputs from views of
that same device buffer, so a graph step needs no further copies. With one GPU a decode graph holds the
whole step: feeding the previous step's tokens, the model, the LM head and the sampler."""
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _update_default_pg, _world

from minivllm.config import Config
from minivllm.engine.sequence import PENDING, Sequence
from minivllm.layers import attention_backend
from minivllm.layers.attention import Attention
from minivllm.layers.sampler import Sampler
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.utils.context import reset_context, set_context
from minivllm.utils.dist import init_process_group
from minivllm.utils.loader import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(config: Config, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if device.type != "cuda":
        return torch.float32
    dtype = getattr(config.hf_config, "dtype", None) or getattr(config.hf_config, "torch_dtype", None) or torch.bfloat16
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


@dataclass(slots=True)
class StepInput:
    """One step's inputs as host arrays (what rank 0 sends to the workers)."""
    is_prefill: bool
    input_ids: np.ndarray          # (T,) int32
    positions: np.ndarray          # (T,) int32
    slot_mapping: np.ndarray       # (T,) int32
    context_lens: np.ndarray       # (S,) int32, keys per sequence after this step
    block_tables: np.ndarray | None  # (S, M) int32, -1 padded; None for a prefill without cached keys
    cu_seqlens_q: np.ndarray | None = None   # (S + 1,) int32, prefill only
    cu_seqlens_k: np.ndarray | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    num_seqs: int = 0              # real sequences (decode may be padded up to a graph size)
    src: np.ndarray | None = None  # (T,) int32: row of the previous step's sampled tokens to feed in, or -1


class StepHandle:
    """A launched step: `result()` waits for its sampled tokens (one per sequence) and returns them."""

    def __init__(self, tokens: torch.Tensor, host: torch.Tensor | None) -> None:
        self.n = tokens.shape[0]
        self.tokens, self.host, self.event = tokens, host, None
        if host is not None:                                   # GPU: copy back without waiting
            host[:self.n].copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> list[int]:
        if self.event is None:
            return self.tokens.tolist()
        self.event.synchronize()
        return self.host[:self.n].tolist()


class ModelRunner:

    def __init__(self, config: Config, rank: int = 0, port: int = 0, worker_conns: list | None = None) -> None:
        self.config = config
        hf = config.hf_config
        self.block_size = config.kvcache_block_size
        self.world_size = config.tensor_parallel_size
        self.rank = rank
        self.worker_conns = worker_conns or []
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.group = None
        if self.world_size > 1:
            # torch.distributed has one default group per process and the layers use it; rank 0 lives in the
            # driver, which may hold several TP engines, so each engine makes its own group the default only
            # while it runs (in launch). The group's name (its key prefix in the store) must be equal on every
            # rank and distinct per engine: the store's port is both.
            _update_default_pg(None)
            _world.group_count = port
            init_process_group(rank, self.world_size, port, "nccl" if self.device.type == "cuda" else "gloo")
            self.group = dist.group.WORLD
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        self.dtype = resolve_dtype(config, self.device)
        attention_backend.set_backend(config.attention_backend)
        self.backend = attention_backend.select(self.device, self.dtype)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        with torch.device(self.device):
            self.model = Qwen3ForCausalLM(hf)
        torch.set_default_dtype(default_dtype)
        load_model(self.model, config.model)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for m in self.attn_layers:
            m.backend = self.backend
        self.sampler = Sampler(config.seed).to(self.device)
        self.max_num_blocks = (config.max_model_len + self.block_size - 1) // self.block_size
        self.enforce_eager = config.enforce_eager or self.device.type != "cuda"
        # the LM head and sampler join the decode graph with one GPU (with TP, the head's gather stays outside)
        self.sample_in_graph = not self.enforce_eager and self.world_size == 1
        self._allocate_step_buffers()
        self.warmup_model()
        self.allocate_kv_cache()
        if not self.enforce_eager:
            self.capture_cudagraph()
        self.sampler.seed.fill_(config.seed)          # warm-up and capture drew noise: start every run alike
        if self.world_size > 1:
            dist.barrier()
            if rank == 0:
                _update_default_pg(None)      # the driver's default group is set only inside step()

    # --- persistent step buffers -------------------------------------------------------------------

    def _allocate_step_buffers(self) -> None:
        c = self.config
        tokens = max(c.max_num_batched_tokens, c.max_num_seqs)
        seqs = c.max_num_seqs
        size = 4 * tokens + 4 * (seqs + 1) + seqs * self.max_num_blocks   # + src, see StepInput
        pin = self.device.type == "cuda"
        # two pinned staging buffers, used on alternate steps: step N+1 is prepared while N's copy may be queued
        self.parity = 0
        self.host_ints_pair = [torch.zeros(size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.host_floats_pair = [torch.zeros(2 * seqs, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self.host_tokens_pair = [torch.zeros(seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)] if pin else None
        self.dev_ints = torch.zeros(size, dtype=torch.int32, device=self.device)
        self.dev_floats = torch.zeros(2 * seqs, device=self.device)
        self.last_sampled = torch.zeros(seqs, dtype=torch.int64, device=self.device)  # feeds PENDING tokens
        # decode's fixed layout: [ids S][positions S][slots S][context_lens S][block tables S x M][src S];
        # floats: [temperatures S][top_ps S]
        S, M, d = seqs, self.max_num_blocks, self.dev_ints
        self.graph_vars = dict(input_ids=d[:S], positions=d[S:2 * S], slot_mapping=d[2 * S:3 * S],
                               context_lens=d[3 * S:4 * S], block_tables=d[4 * S:4 * S + S * M].view(S, M),
                               src=d[4 * S + S * M:5 * S + S * M], temperatures=self.dev_floats[:S])

    def _upload(self, arrays: list[np.ndarray], fixed_offsets: list[int] | None = None) -> list[torch.Tensor]:
        """Copy host arrays to the device in one transfer, through the pinned staging buffer. Packed
        back to back, or at `fixed_offsets` (decode graphs read fixed places). Returns device views."""
        host_ints = self.host_ints_pair[self.parity]
        host = host_ints.numpy()
        offsets, end = [], 0
        for i, a in enumerate(arrays):
            start = fixed_offsets[i] if fixed_offsets else end
            host[start:start + a.size] = a.ravel()
            offsets.append(start)
            end = start + a.size
        self.dev_ints[:end].copy_(host_ints[:end], non_blocking=True)
        return [self.dev_ints[o:o + a.size].view(a.shape) for o, a in zip(offsets, arrays)]

    # --- step inputs (rank 0) ----------------------------------------------------------------------

    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        table = np.asarray(seq.block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _block_tables(self, seqs: list[Sequence], rows: int, width: int | None = None) -> np.ndarray:
        """(rows, width) int32, -1 padded; width defaults to the longest table in the batch."""
        width = width or max(1, max(len(s.block_table) for s in seqs))
        tables = np.full((rows, width), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        return tables

    def prepare_prefill(self, seqs: list[Sequence]) -> StepInput:
        starts = np.array([s.num_computed_tokens for s in seqs])
        ends = starts + np.array([s.num_scheduled_tokens for s in seqs])
        input_ids = np.concatenate([s.token_ids[a:b] for s, a, b in zip(seqs, starts, ends)]).astype(np.int32)
        positions = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)]).astype(np.int32)
        slot_mapping = np.concatenate([self._slots(s, a, b) for s, a, b in zip(seqs, starts, ends)]).astype(np.int32)
        cu_q = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(ends)]).astype(np.int32)
        cached = bool((starts > 0).any())                        # some keys come from the cache
        rows = np.repeat([s.sample_row for s in seqs], ends - starts)
        return StepInput(True, input_ids, positions, slot_mapping, ends.astype(np.int32),
                         self._block_tables(seqs, len(seqs)) if cached else None, cu_q, cu_k,
                         int((ends - starts).max()), int(ends.max()), len(seqs), self._pending(input_ids, rows))

    @staticmethod
    def _pending(input_ids: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
        """Tokens still being sampled (PENDING) are fed from the previous step's output on the device."""
        pending = input_ids == PENDING
        if not pending.any():
            return None
        input_ids[pending] = 0
        return np.where(pending, rows, -1).astype(np.int32)

    def graph_batch_size(self, bs: int) -> int:
        return bs if self.enforce_eager else next(b for b in self.graph_bs if b >= bs)

    def prepare_decode(self, seqs: list[Sequence]) -> StepInput:
        bs, rows = len(seqs), self.graph_batch_size(len(seqs))        # pad up to a captured size
        input_ids = np.zeros(rows, dtype=np.int32)
        positions = np.zeros(rows, dtype=np.int32)
        slot_mapping = np.full(rows, -1, dtype=np.int32)               # padding writes nothing
        context_lens = np.zeros(rows, dtype=np.int32)
        for i, s in enumerate(seqs):
            p = s.num_tokens - 1
            input_ids[i], positions[i], context_lens[i] = s.last_token, p, s.num_tokens
            slot_mapping[i] = s.block_table[p // self.block_size] * self.block_size + p % self.block_size
        tables = self._block_tables(seqs, rows, None if self.enforce_eager else self.max_num_blocks)  # graphs: fixed width
        sample_rows = np.array([s.sample_row for s in seqs] + [-1] * (rows - bs))
        src = self._pending(input_ids, sample_rows)
        if src is None and self.sample_in_graph:             # the graph always feeds: -1 = keep the id
            src = np.full(rows, -1, dtype=np.int32)
        return StepInput(False, input_ids, positions, slot_mapping, context_lens, tables, num_seqs=bs, src=src)

    def prepare_sample(self, seqs: list[Sequence], in_graph: bool = False):
        """(temperatures, top_ks, top_ps) on the device; None where not needed: temperatures when every row is
        greedy (unless the graph samples: it reads them), top_ks / top_ps when no row filters."""
        sp = [s.sampling_params for s in seqs]
        n, S = len(seqs), self.config.max_num_seqs
        if all(p.temperature == 0 for p in sp) and not in_graph:   # all greedy: argmax, no noise, no filters
            return None, None, None
        host_floats = self.host_floats_pair[self.parity]
        floats = host_floats.numpy()
        floats[:n] = [p.temperature for p in sp]
        floats[S:S + n] = [p.top_p for p in sp]
        top_ks = np.array([p.top_k for p in sp], dtype=np.int32)
        filtering = bool(top_ks.any()) or any(p.top_p < 1 for p in sp)
        end = S + n if filtering else n
        self.dev_floats[:end].copy_(host_floats[:end], non_blocking=True)
        temperatures, top_ps = self.dev_floats[:n], self.dev_floats[S:S + n]
        if not filtering:
            return temperatures, None, None
        return temperatures, torch.from_numpy(top_ks).to(self.device, non_blocking=True), top_ps

    # --- running a step ------------------------------------------------------------------------------

    def step(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """Rank 0: run one step on every rank and wait for one sampled token per sequence."""
        return self.launch(seqs, is_prefill).result()

    def launch(self, seqs: list[Sequence], is_prefill: bool) -> StepHandle:
        """Rank 0: prepare and launch one step on every rank without waiting for it (on a GPU the host
        goes on to schedule the next step while this one runs)."""
        inputs = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        assert inputs.src is None or not self.worker_conns, "TP workers cannot see rank 0's sampled tokens"
        for i, seq in enumerate(seqs):
            seq.sample_row = i
        for conn in self.worker_conns:
            conn.send(("run_model", inputs))
        in_graph = self.sample_in_graph and not is_prefill
        sampling = self.prepare_sample(seqs, in_graph)
        graph_sampled = in_graph and sampling[1] is None           # no top-k / top-p row: the graph's draw stands
        if self.group is not None:
            _update_default_pg(self.group)
        try:
            logits = self.run_model(inputs, need_logits=not graph_sampled)
        finally:
            if self.group is not None:
                _update_default_pg(None)
        if graph_sampled:
            tokens = self.last_sampled[:len(seqs)]                # the graph sampled them
        else:                                                      # prefill, eager, TP, or top-k / top-p rows
            tokens = self.sampler(logits, *sampling)               # (num_seqs,) int64, on the device
            self.last_sampled[:tokens.shape[0]] = tokens
        host = self.host_tokens_pair[self.parity] if self.host_tokens_pair else None
        self.parity ^= 1
        return StepHandle(tokens, host)

    @torch.inference_mode()
    def run_model(self, inp: StepInput, need_logits: bool = True) -> torch.Tensor | None:
        """Logits of the last token of each sequence (rank 0; None on the other ranks). A decode graph that
        samples (one GPU) returns None unless `need_logits`: its tokens are in `last_sampled`."""
        if not inp.is_prefill and not self.enforce_eager:
            return self._replay(inp, need_logits)
        arrays = [inp.input_ids, inp.positions, inp.slot_mapping, inp.context_lens]
        if inp.is_prefill:
            arrays += [inp.cu_seqlens_q, inp.cu_seqlens_k]
        if inp.block_tables is not None:
            arrays.append(inp.block_tables)
        if inp.src is not None:
            arrays.append(inp.src)
        t = self._upload(arrays)
        input_ids, positions, slot_mapping, context_lens = t[:4]
        if inp.src is not None:
            self._feed_pending(input_ids, t[-1])
        if inp.is_prefill:
            set_context(True, t[4], t[5], inp.max_seqlen_q, inp.max_seqlen_k, slot_mapping, context_lens,
                        t[6] if inp.block_tables is not None else None)
        else:
            set_context(False, slot_mapping=slot_mapping, context_lens=context_lens, block_tables=t[4])
        logits = self.model.compute_logits(self.model(input_ids, positions))
        reset_context()
        return logits

    def _replay(self, inp: StepInput, need_logits: bool) -> torch.Tensor | None:
        S, M = self.config.max_num_seqs, self.max_num_blocks
        arrays = [inp.input_ids, inp.positions, inp.slot_mapping, inp.context_lens, inp.block_tables]
        offsets = [0, S, 2 * S, 3 * S, 4 * S]
        if inp.src is not None:
            arrays.append(inp.src)
            offsets.append(4 * S + S * M)
        t = self._upload(arrays, fixed_offsets=offsets)
        bs = inp.input_ids.shape[0]
        if inp.src is not None and not self.sample_in_graph:
            self._feed_pending(t[0], t[-1])
        self.graphs[bs].replay()
        if self.sample_in_graph and not need_logits:
            return None
        return self.model.compute_logits(self.graph_outputs[:inp.num_seqs])

    def _feed_pending(self, input_ids: torch.Tensor, src: torch.Tensor) -> None:
        """input_ids[i] = previous step's sampled token src[i] where src[i] >= 0, on the device (no sync)."""
        fed = self.last_sampled[src.clamp(min=0).long()].to(input_ids.dtype)
        torch.where(src >= 0, fed, input_ids, out=input_ids)

    # --- start-up: warm-up, KV cache, CUDA graphs ------------------------------------------------------

    @torch.inference_mode()
    def warmup_model(self) -> None:
        """Run the largest prefill (and the sampler on the largest batch) once, so that kernels are compiled
        and the peak activation memory is known before the KV cache takes the rest."""
        c = self.config
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        seq_len = min(c.max_model_len, c.max_num_batched_tokens)
        num_seqs = max(1, min(c.max_num_batched_tokens // seq_len, c.max_num_seqs))
        seqs = [Sequence([0] * seq_len) for _ in range(num_seqs)]
        for s in seqs:
            s.num_scheduled_tokens = seq_len
            s.block_table = list(range(self.max_num_blocks))
        self.run_model(self.prepare_prefill(seqs))
        if self.rank == 0:
            vocab = self.config.hf_config.vocab_size
            logits = torch.zeros(c.max_num_seqs, vocab, device=self.device, dtype=self.dtype)
            t = torch.ones(c.max_num_seqs, device=self.device)
            self.sampler(logits, t, torch.ones_like(t, dtype=torch.int32), t)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def allocate_kv_cache(self) -> None:
        c, hf = self.config, self.config.hf_config
        num_kv_heads = hf.num_key_value_heads // self.world_size
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        block_bytes = 2 * hf.num_hidden_layers * self.block_size * num_kv_heads * head_dim * self.dtype.itemsize
        if c.num_kvcache_blocks > 0:
            num_blocks = c.num_kvcache_blocks
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info()
            stats = torch.cuda.memory_stats()
            peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
            num_blocks = int(total * c.gpu_memory_utilization - (total - free) - peak + current) // block_bytes
        else:
            num_blocks = c.cpu_kvcache_bytes // block_bytes
        if self.world_size > 1:                              # every rank must agree on the block count
            n = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MIN)
            num_blocks = int(n.item())
        if num_blocks < 1:
            where = (f"gpu_memory_utilization={c.gpu_memory_utilization} of the GPU is already in use (another LLM "
                     "alive in this process? call its exit(), or lower gpu_memory_utilization)"
                     if self.device.type == "cuda" and c.num_kvcache_blocks <= 0 else "the KV cache budget is too small")
            raise RuntimeError(f"no memory left for the KV cache (one block needs {block_bytes} bytes): {where}")
        c.num_kvcache_blocks = num_blocks
        # zero-initialised: unused rows must be finite for the flash kernels
        self.kv_cache = torch.zeros(2, hf.num_hidden_layers, num_blocks, self.block_size, num_kv_heads, head_dim,
                                    dtype=self.dtype, device=self.device)
        for i, m in enumerate(self.attn_layers):
            m.k_cache, m.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    @torch.inference_mode()
    def capture_cudagraph(self) -> None:
        max_bs = self.config.max_num_seqs
        self.graph_bs = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16)) + [max_bs]
        self.graph_outputs = torch.zeros(max_bs, self.config.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        v = self.graph_vars
        v["slot_mapping"].fill_(-1)
        v["context_lens"].zero_()
        v["block_tables"].fill_(0)
        v["src"].fill_(-1)
        self.graphs, pool = {}, None
        for bs in reversed(self.graph_bs):
            graph = torch.cuda.CUDAGraph()
            self._decode_step(bs)                                                              # warm-up
            with torch.cuda.graph(graph, pool):
                self._decode_step(bs)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def _decode_step(self, bs: int) -> None:
        """What a decode graph of batch `bs` runs. With one GPU the whole step: feed the previous step's
        tokens, the model, the LM head, the sampler (its tokens land in `last_sampled`)."""
        v = self.graph_vars
        # a fresh context per capture: what the layers derive from it (the page table) is made inside the graph
        set_context(False, slot_mapping=v["slot_mapping"][:bs], context_lens=v["context_lens"][:bs],
                    block_tables=v["block_tables"][:bs])
        if self.sample_in_graph:
            self._feed_pending(v["input_ids"][:bs], v["src"][:bs])
        self.graph_outputs[:bs] = self.model(v["input_ids"][:bs], v["positions"][:bs])
        if self.sample_in_graph:
            logits = self.model.compute_logits(self.graph_outputs[:bs])                      # (bs, vocab)
            self.sampler.race_kernel(logits, v["temperatures"][:bs], out=self.last_sampled[:bs])
        reset_context()

    # --- tensor-parallel workers -------------------------------------------------------------------------

    def exit(self) -> None:
        for conn in self.worker_conns:
            try:
                conn.send(("exit", None))
            except (BrokenPipeError, OSError):
                pass
        self.worker_conns = []
        for m in getattr(self, "attn_layers", []):                 # give the memory back (KV cache, graphs)
            m.k_cache = m.v_cache = torch.tensor([])
        for name in ("graphs", "graph_outputs", "kv_cache", "model"):
            self.__dict__.pop(name, None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        if self.group is not None:
            if dist.group.WORLD is self.group:
                _update_default_pg(None)
            dist.destroy_process_group(self.group)    # this engine's group only, not another engine's
            self.group = None


def worker_main(config: Config, rank: int, port: int, conn) -> None:
    """A tensor-parallel worker: run whatever rank 0 sends until it says exit or goes away."""
    runner = ModelRunner(config, rank, port)
    try:
        while True:
            try:
                method, arg = conn.recv()
            except (EOFError, OSError):          # the driver is gone
                break
            if method == "exit":
                break
            getattr(runner, method)(arg)
    finally:
        runner.exit()
