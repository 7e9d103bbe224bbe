"""Runs the model for one scheduled step (nano-vllm's model_runner.py; notebook 13): builds the model and its KV
cache, uploads the step's inputs (step_inputs.py), sets the step context, runs the model (eagerly, or by replaying
a decode graph: cuda_graphs.py) and samples on rank 0. Rank 0 also sends each step to the tensor-parallel workers
(tp_workers.py), which run the same forward. The engine's kernels (`kernels.pick`), attention backend and TP group
are chosen once and given to the model when it is built; a GPU engine's kernels compile beside the load
(`kernels.begin_compile`, kernels/startup/)."""

import time

import torch

from minivllm import kernels
from minivllm.config import Config
from minivllm.engine import cuda_graphs, step_inputs
from minivllm.engine.cuda_graphs import DecodeGraphs
from minivllm.engine.kv_cache import GpuMemory, allocate_zeroed, kv_block_bytes, kv_cache_shape, num_kvcache_blocks
from minivllm.engine.request import StepHandle
from minivllm.engine.sequence import Sequence
from minivllm.engine.step_inputs import DecodeLayout, InputBuffers, StepInput
from minivllm.engine.tp_workers import destroy_engine_group, min_over_ranks, new_engine_group
from minivllm.layers.attention import Attention
from minivllm.layers.sampler import Sampler
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.utils.context import reset_context, set_context
from minivllm.utils.loader import load_model

EMPTY = torch.tensor([])  # an attention layer's cache before the runner gives it one


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0, port: int = 0, workers=None, reporter=None) -> None:
        """`workers`: rank 0's of a tensor-parallel engine (tp_workers.Workers); `reporter`: a worker's pipe to rank 0,
        on which it reports each start-up phase done (`checkpoint`)."""
        start = time.perf_counter()
        self.config = config
        self.block_size = config.kvcache_block_size
        self.world_size = config.tensor_parallel_size
        self.rank = rank
        self.workers, self.reporter = workers, reporter  # rank 0 drives the workers; a worker reports to rank 0
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.dtype = config.torch_dtype()
        self.group = self.init_process_group(port)
        # GPU: FlashAttention-4's prefill kernel and our Triton kernels compile beside the load (kernels/startup)
        self.compile_ahead = kernels.begin_compile(config, self.device, self.dtype, rank)
        try:
            name = kernels.attention_backends.select(self.device, self.dtype, config.attention_backend)
            self.ops = kernels.pick(self.device, self.dtype, backend=name, options=config.kernels)
            self.backend = kernels.attention_backends.create(name, decode=self.ops.paged_decode)
            self.prefill_keys_from_cache = self.backend.keys_from_cache
            self.sampler = Sampler(config.seed, self.device, self.ops)
            self.allocate_buffers()
            # seconds per start-up phase; "setup": the GPU's context, the attention backend's import, the buffers
            self.startup_seconds: dict[str, float] = {"setup": time.perf_counter() - start}
            gpu = self.device.type == "cuda"
            self.timed("load", self.load_model)
            self.checkpoint("loaded the model")
            self.startup_seconds.update(self.compile_ahead.wait())  # the kernels compiled ahead, before the warm-up
            # the largest prefill and the sampler (kernels/startup/warmup.py); a CPU's KV cache has a byte budget
            self.timed("warmup", lambda: self.compile_ahead.warmup_model(self), gpu)
            self.timed("kv_cache", self.allocate_kv_cache)
            self.checkpoint("allocated the KV cache")
            self.timed("warmup_attention", lambda: self.compile_ahead.warmup_attention(self), gpu)  # over the cache
            self.timed("capture", self.capture_cudagraph, not self.enforce_eager)
            self.checkpoint("captured the CUDA graphs")
        except BaseException:
            self.compile_ahead.cancel()  # a start-up that fails leaves no helper compiling
            raise
        self.sampler.reset(config.seed)  # warm-up and capture drew noise: start every run alike

    def init_process_group(self, port: int):
        """This engine's process group over its tensor-parallel ranks (None with one), and its GPU."""
        group = None
        if self.world_size > 1:
            self.checkpoint("started")  # rank 0 joins the group only once every worker is alive to join it
            group = new_engine_group(self.rank, self.world_size, port, "nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        return group

    def allocate_buffers(self) -> None:
        """The persistent buffers a step's inputs and sampled tokens travel through (step_inputs.py)."""
        config = self.config
        self.max_num_blocks = -(-config.max_model_len // self.block_size)
        self.enforce_eager = config.enforce_eager or self.device.type != "cuda"
        # the LM head and sampler join the decode graph with one GPU (with TP, the head's gather stays outside)
        self.sample_in_graph = not self.enforce_eager and self.world_size == 1
        layout = DecodeLayout(max_seqs=config.max_num_seqs, max_blocks=self.max_num_blocks)
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.buffers = InputBuffers(max_tokens=max_tokens, layout=layout, device=self.device)
        self.last_sampled = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.graphs: DecodeGraphs | None = None

    def timed(self, phase: str, fn, run: bool = True) -> None:
        """Run start-up phase `fn` and record its seconds (its GPU work included); a phase this engine skips (`run`
        false) is not listed."""
        if run:
            start = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.startup_seconds[phase] = time.perf_counter() - start

    def load_model(self) -> None:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        with torch.device(self.device):
            self.model = Qwen3ForCausalLM(
                self.config.hf_config, ops=self.ops, attn_backend=self.backend, group=self.group
            )
        torch.set_default_dtype(default_dtype)
        load_model(self.model, self.config.model)
        for m in self.model.modules():
            if hasattr(m, "pack_weight"):
                m.pack_weight()  # the kernel's copy of each weight, once (CPU: oneDNN's layout)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]

    def checkpoint(self, phase: str) -> None:
        """Start-up: a worker reports `phase` done; rank 0 waits until every worker has (tp_workers.py)."""
        if self.reporter is not None:
            self.reporter.send(("done", phase, None))
        elif self.workers is not None:
            self.workers.wait_for(phase)

    def prepare_prefill(self, seqs: list[Sequence]) -> StepInput:
        return step_inputs.prepare_prefill(seqs, self.block_size, keys_from_cache=self.prefill_keys_from_cache)

    def prepare_decode(self, seqs: list[Sequence]) -> StepInput:
        if self.enforce_eager:
            return step_inputs.prepare_decode(seqs, self.block_size, rows=len(seqs))
        # a graph's batch: padded up to a captured size, its block tables in a fixed layout
        rows, width, feed = self.graphs.padded(len(seqs)), self.max_num_blocks, self.sample_in_graph
        return step_inputs.prepare_decode(seqs, self.block_size, rows=rows, table_width=width, always_feed=feed)

    def prepare_sample(self, seqs: list[Sequence], in_graph: bool) -> torch.Tensor | None:
        """The rows' temperatures (B,) float32 on the device; None: all greedy and no graph reads them (argmax)."""
        temperatures = [seq.sampling_params.temperature for seq in seqs]
        if not in_graph and not any(temperatures):
            return None
        return self.buffers.upload_floats(temperatures, None)[0]

    def launch(self, seqs: list[Sequence], is_prefill: bool, hook=None) -> StepHandle:
        """Rank 0: launch one step on every rank without waiting (the host goes on to schedule the next step while
        the GPU runs this one); `hook`: the engine's sampling extras (frontend/sampling_hook.py)."""
        inputs = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        assert inputs.src is None or self.workers is None, "TP workers cannot see rank 0's sampled tokens"
        for i, seq in enumerate(seqs):
            seq.sample_row = i
        if self.workers is not None:
            self.workers.send("run_model", inputs)
        in_graph = self.sample_in_graph and not is_prefill
        # sampling hook: the step's extras (None: temperatures only, as nano-vllm)
        extras = hook.prepare(seqs, self.buffers, device=self.device, in_graph=in_graph) if hook else None
        temperatures = self.prepare_sample(seqs, in_graph) if extras is None else None
        graph_sampled = in_graph and (extras is None or hook.is_plain(extras))  # the graph's draw stands
        scoring = hook.plan_prompt_logprobs(seqs) if hook and is_prefill else None  # sampling hook: prompt logprobs
        logits = self.run_model(inputs, need_logits=not graph_sampled, keep_hidden=scoring is not None)
        if graph_sampled:
            tokens, logprobs = self.last_sampled[: len(seqs)], None  # the graph sampled them
        elif extras is None:  # prefill, eager or TP: nano-vllm's sampler
            tokens, logprobs = self.sampler(logits, temperatures), None  # (num_seqs,) int64, on the device
        else:  # sampling hook: rows that need more than temperature, outside the graph
            tokens, logprobs = hook.sample(self.sampler, logits, extras)
        if not graph_sampled:
            self.last_sampled[: tokens.shape[0]] = tokens
        handle = StepHandle(tokens, self.buffers.host_tokens_buffer(), logprobs)
        if scoring is not None:  # sampling hook: the prompt positions scored
            handle.prompt_logprobs = scoring, hook.score_prompt_logprobs(self.model.lm_head, self.hidden, scoring)
            self.hidden = None
        self.buffers.flip()
        return handle

    @torch.inference_mode()
    def run_model(self, inp: StepInput, need_logits: bool = True, keep_hidden: bool = False) -> torch.Tensor | None:
        """Logits of the last token of each sequence (rank 0; None on the other ranks). A decode graph that
        samples (one GPU) returns None unless `need_logits`: its tokens are in `last_sampled`."""
        if not inp.is_prefill and not self.enforce_eager:
            return cuda_graphs.replay(self, inp, need_logits)
        t = self.buffers.upload_step(inp)
        if inp.src is not None:
            self.feed_pending(t["input_ids"], t["src"])
        set_context(
            inp.is_prefill,
            cu_seqlens_q=t.get("cu_seqlens_q"),
            cu_seqlens_k=t.get("cu_seqlens_k"),
            max_seqlen_q=inp.max_seqlen_q,
            max_seqlen_k=inp.max_seqlen_k,
            slot_mapping=t["slot_mapping"],
            context_lens=t["context_lens"],
            block_tables=t.get("block_tables"),
            num_decode_rows=inp.num_decode_rows,
        )
        hidden = self.model(t["input_ids"], t["positions"])
        self.hidden = hidden if keep_hidden else None  # prompt logprobs read every position (prompt_logprobs.py)
        logits = self.model.compute_logits(hidden)
        reset_context()
        return logits

    def feed_pending(self, input_ids: torch.Tensor, src: torch.Tensor) -> None:
        """input_ids[i] = previous step's sampled token src[i] where src[i] >= 0, on the device (no sync)."""
        fed = self.last_sampled[src.clamp(min=0).long()].to(input_ids.dtype)
        torch.where(src >= 0, fed, input_ids, out=input_ids)

    def allocate_kv_cache(self) -> None:
        block_bytes = kv_block_bytes(self.config, self.dtype)
        gpu = GpuMemory.measure(self.device) if self.device.type == "cuda" else None
        num_blocks = num_kvcache_blocks(
            self.config, block_bytes, gpu, agree=lambda n: min_over_ranks(n, self.device, self.group)
        )
        self.config.num_kvcache_blocks = num_blocks
        self.kv_cache = allocate_zeroed(kv_cache_shape(self.config, num_blocks), self.dtype, self.device)
        self.bind_kv_cache(self.kv_cache)

    def bind_kv_cache(self, kv_cache: torch.Tensor | None) -> None:
        """Hand each attention layer its K and V cache: `kv_cache[0, layer]`, `kv_cache[1, layer]` (None: none)."""
        for i, m in enumerate(self.attn_layers):
            m.k_cache, m.v_cache = (kv_cache[0, i], kv_cache[1, i]) if kv_cache is not None else (EMPTY, EMPTY)

    def capture_cudagraph(self) -> None:
        self.graphs = cuda_graphs.capture(self)  # one graph per batch size (cuda_graphs.py)

    def exit(self) -> None:
        if hasattr(self, "attn_layers"):  # give the memory back (KV cache, graphs)
            self.bind_kv_cache(None)
        for name in ("graphs", "kv_cache", "model"):
            self.__dict__.pop(name, None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        if self.group is not None:
            destroy_engine_group(self.group)
            self.group = None
