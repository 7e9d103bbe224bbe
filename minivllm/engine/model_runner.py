"""Runs the model for one scheduled step (nano-vllm's model_runner.py; notebook 13): builds the model and
its KV cache, uploads the step's inputs, sets the step context, runs the model (eagerly, or by replaying a
CUDA graph for decode) and samples on rank 0. Rank 0 also sends each step to the tensor-parallel workers
(`tp_workers.py`), which run the same forward.

The pieces it uses, each in its own file: `step_inputs.py` (a step's inputs on the host, and the buffers
they reach the device through), `cuda_graphs.py` (decode graphs), `kv_cache.py` (how many blocks fit). With
one GPU a decode graph holds the whole step: feeding the previous step's tokens, the model, the LM head and
the sampler, whose tokens land in `last_sampled` (benchmarks/NOTES.md says what each of these saves)."""

import time

import torch
import torch.distributed as dist

from minivllm.config import Config
from minivllm.engine import attention_compile, prompt_logprobs, step_inputs, triton_compile, warmup
from minivllm.engine.cuda_graphs import DecodeGraphs
from minivllm.engine.kv_cache import GpuMemory, allocate_zeroed, kv_block_bytes, kv_cache_shape, num_kvcache_blocks
from minivllm.engine.sampling_inputs import SamplingInputs, prepare_sampling, sample_tokens
from minivllm.engine.sequence import Sequence
from minivllm.engine.step_inputs import DecodeLayout, InputBuffers, StepInput
from minivllm.engine.tp_workers import Reporter, Workers
from minivllm.layers import attention_backend, cpu_linear, cpu_ops
from minivllm.layers.attention import Attention
from minivllm.layers.logprobs import LogprobsTensors
from minivllm.layers.paged_decode import num_splits
from minivllm.layers.sampler import Sampler
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.utils.context import reset_context, set_context
from minivllm.utils.dist import destroy_engine_group, engine_group, new_engine_group
from minivllm.utils.loader import load_model
from minivllm.utils.switches import SWITCHES


class StepHandle:
    """A launched step: `result()` waits for its sampled tokens (one per sequence) and returns them, with the
    log-probabilities of the rows that asked for them ({row: (top ids, top logprobs, logprob, rank)})."""

    def __init__(self, tokens: torch.Tensor, host: torch.Tensor | None, logprobs: LogprobsTensors | None = None):
        # `tokens` may be a view of `last_sampled`, which the next step overwrites: take the values now
        self.n = tokens.shape[0]
        self.tokens, self.host, self.event = tokens if host is not None else tokens.clone(), host, None
        self.logprobs = logprobs
        self.prompt_logprobs = None  # (PromptScoring, LogprobsTensors) of the rows that asked (prompt_logprobs.py)
        if host is not None:  # GPU: copy back without waiting (ordered before the next step's writes)
            host[: self.n].copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> tuple[list[int], dict[int, tuple]]:
        if self.event is None:
            tokens = self.tokens.tolist()
        else:
            self.event.synchronize()
            tokens = self.host[: self.n].tolist()
        return tokens, self.logprobs.tolists() if self.logprobs is not None else {}


def decode_graph_variant(batch: int, num_kv_heads: int) -> tuple[int, bool]:
    """Which compiled kernels a decode graph of `batch` sequences launches: the same for two batch sizes unless
    the decode attention's split count differs (its split and combine kernels) or one of them is 1 (Triton
    specialises integer arguments equal to 1)."""
    return num_splits(batch, num_kv_heads), batch == 1


class ModelRunner:
    def __init__(
        self,
        config: Config,
        rank: int = 0,
        port: int = 0,
        workers: Workers | None = None,
        reporter: Reporter | None = None,
    ) -> None:
        start = time.perf_counter()
        self.config = config
        self.eos: list[int] = []  # end-of-sequence ids, masked until a request's min_tokens (the engine sets them)
        self.vocab_size = config.hf_config.vocab_size
        self.block_size = config.kvcache_block_size
        self.world_size = config.tensor_parallel_size
        self.rank = rank
        self.workers, self.reporter = workers, reporter  # rank 0 drives the workers; a worker reports to rank 0
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.group = None
        if self.world_size > 1:
            self.checkpoint("started")  # rank 0 joins the group only once every worker is alive to join it
            self.group = new_engine_group(rank, self.world_size, port, "nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = config.torch_dtype()
        # FlashAttention-4's one prefill kernel compiles during load and warm-up (engine/attention_compile.py): in
        # this process's helper, sent its request before `select` imports FlashAttention-4 here, or on a thread
        # after. The helper serves the first engine or none: one that does not use it stops it.
        where = attention_compile.where_to_compile(config, self.device, self.dtype, SWITCHES.attention_compile)
        helper = attention_compile.claim_helper()
        self.attention_compile: attention_compile.AttentionCompile | None = None
        if where == "process":
            self.attention_compile = attention_compile.start(config, self.device, self.dtype, "process", helper=helper)
        elif helper is not None:
            helper.cancel()
        try:
            self.start_up(where, start)
        except BaseException:
            if self.attention_compile is not None:
                self.attention_compile.cancel()  # a start-up that fails leaves no helper compiling
            raise

    def start_up(self, where: str | None, start: float) -> None:
        """The rest of the engine's start: our Triton kernels' compile on threads, the attention backend, the
        buffers, then the timed phases (load, the wait for the Triton kernels, warm-up, KV cache, attention
        warm-up, graph capture)."""
        config = self.config
        # our Triton kernels compile on threads (engine/triton_compile.py) while this thread imports the attention
        # backend and loads the model; the warm-up waits for them
        on_threads = self.device.type == "cuda" and SWITCHES.triton_compile
        kernels = triton_compile.start(config, self.device, self.dtype, self.rank) if on_threads else None
        self.backend = attention_backend.select(self.device, self.dtype, config.attention_backend)
        # FlashAttention-4 compiles one kernel per variant it meets (~3-4 s each): keys fresh or read through the
        # page table is one of its distinctions, so with it every prefill reads its keys from the cache (the
        # layer has just written them there) and one variant serves them all (benchmarks/NOTES.md, change 16)
        self.prefill_keys_from_cache = self.backend == "fa4"
        if self.backend != "fa4" and self.attention_compile is not None:
            self.attention_compile.cancel()  # FlashAttention-4 was expected but did not import
            self.attention_compile = None
        if self.backend == "fa4" and where == "thread":
            self.attention_compile = attention_compile.start(config, self.device, self.dtype, "thread")
        self.sampler = Sampler(config.seed, self.device)
        self.max_num_blocks = -(-config.max_model_len // self.block_size)
        self.enforce_eager = config.enforce_eager or self.device.type != "cuda"
        # the LM head and sampler join the decode graph with one GPU (with TP, the head's gather stays outside)
        self.sample_in_graph = not self.enforce_eager and self.world_size == 1
        layout = DecodeLayout(max_seqs=config.max_num_seqs, max_blocks=self.max_num_blocks)
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.buffers = InputBuffers(max_tokens=max_tokens, layout=layout, device=self.device)
        self.last_sampled = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.graphs: DecodeGraphs | None = None
        # where the engine's start went, phase by phase; "setup": the GPU's context, the attention backend's
        # import (FlashAttention-4's takes seconds), the sampler and the input buffers
        self.startup_seconds: dict[str, float] = {"setup": time.perf_counter() - start}
        with engine_group(self.group):  # the layers shard themselves over this engine's group
            self.timed("load", self.load_model)
            self.checkpoint("loaded the model")
            if kernels is not None:
                self.timed("triton_compile", kernels.wait)
            if self.device.type == "cuda":  # on CPU nothing compiles and the cache has a byte budget
                self.timed("warmup", self.warmup_model)
            if self.attention_compile is not None and self.attention_compile.where == "process":
                # its GPU memory must be gone before the KV cache takes what is left
                self.timed("attention_process", self.attention_compile.wait)
            self.timed("kv_cache", self.allocate_kv_cache)
            self.checkpoint("allocated the KV cache")
            if self.device.type == "cuda":
                self.timed("warmup_attention", self.warmup_attention)
            if not self.enforce_eager:
                self.timed("capture", self.capture_cudagraph)
            self.checkpoint("captured the CUDA graphs")
        self.sampler.reset(config.seed)  # warm-up and capture drew noise: start every run alike

    def timed(self, phase: str, fn) -> None:
        t = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.startup_seconds[phase] = time.perf_counter() - t

    def load_model(self) -> None:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        with torch.device(self.device):
            self.model = Qwen3ForCausalLM(self.config.hf_config)
        torch.set_default_dtype(default_dtype)
        load_model(self.model, self.config.model)
        if self.device.type == "cpu" and SWITCHES.cpu_packed_linear:
            cpu_linear.pack_linears(self.model)  # the weights in oneDNN's layout, once (layers/cpu_linear.py)
        cpu_ops.log_choice(self.device)  # CPU: the C++ operators, loaded here, or the torch ops (layers/cpu_ops.py)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for m in self.attn_layers:
            m.backend = self.backend

    def checkpoint(self, phase: str) -> None:
        """Start-up: a worker reports `phase` done; rank 0 waits until every worker has (tp_workers.py)."""
        if self.reporter is not None:
            self.reporter.checkpoint(phase)
        elif self.workers is not None:
            self.workers.wait_for(phase)

    # --- a step's inputs ------------------------------------------------------------------------------

    def prepare_prefill(self, seqs: list[Sequence]) -> StepInput:
        return step_inputs.prepare_prefill(seqs, self.block_size, keys_from_cache=self.prefill_keys_from_cache)

    def prepare_decode(self, seqs: list[Sequence]) -> StepInput:
        graphs = not self.enforce_eager
        return step_inputs.prepare_decode(
            seqs,
            self.block_size,
            rows=self.graphs.padded(len(seqs)) if graphs else len(seqs),  # pad up to a captured size
            table_width=self.max_num_blocks if graphs else None,  # graphs read a fixed layout
            always_feed=self.sample_in_graph,
        )

    def prepare_sample(self, seqs: list[Sequence], in_graph: bool = False) -> SamplingInputs:
        """The step's sampling tensors on the device (sampling_inputs.py): temperatures only for the common
        batch (None when every row is greedy, unless the graph samples: it reads them), more for rows that
        ask for penalties, min_tokens, seeds, filters or logprobs."""
        return prepare_sampling(
            seqs, self.buffers, device=self.device, eos=self.eos, vocab=self.vocab_size, in_graph=in_graph
        )

    def sample(self, logits: torch.Tensor, s: SamplingInputs) -> tuple[torch.Tensor, LogprobsTensors | None]:
        """The eager sampling path (sampling_inputs.sample_tokens): rows that need more than the graph's draw."""
        return sample_tokens(self.sampler, logits, s)

    # --- running a step ---------------------------------------------------------------------------------

    def step(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """Rank 0: run one step on every rank and wait for one sampled token per sequence."""
        return self.launch(seqs, is_prefill).result()[0]

    def launch(self, seqs: list[Sequence], is_prefill: bool) -> StepHandle:
        """Rank 0: prepare and launch one step on every rank without waiting for it (on a GPU the host goes on
        to schedule the next step while this one runs)."""
        inputs = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        assert inputs.src is None or self.workers is None, "TP workers cannot see rank 0's sampled tokens"
        for i, seq in enumerate(seqs):
            seq.sample_row = i
        if self.workers is not None:
            self.workers.send("run_model", inputs)
        in_graph = self.sample_in_graph and not is_prefill
        sampling = self.prepare_sample(seqs, in_graph)
        graph_sampled = in_graph and sampling.plain  # temperatures only: the graph's draw stands
        scoring = prompt_logprobs.plan(seqs) if is_prefill else None  # rows asking for prompt logprobs
        with engine_group(self.group):
            logits = self.run_model(inputs, need_logits=not graph_sampled, keep_hidden=scoring is not None)
        logprobs = None
        if graph_sampled:
            tokens = self.last_sampled[: len(seqs)]  # the graph sampled them
        else:  # prefill, eager, TP, or rows that need more than temperature (outside the graph)
            tokens, logprobs = self.sample(logits, sampling)  # (num_seqs,) int64, on the device
            self.last_sampled[: tokens.shape[0]] = tokens
        handle = StepHandle(tokens, self.buffers.host_tokens_buffer(), logprobs)
        if scoring is not None:
            handle.prompt_logprobs = scoring, prompt_logprobs.score(self.model.lm_head, self.hidden, scoring)
            self.hidden = None
        self.buffers.flip()
        return handle

    @torch.inference_mode()
    def run_model(self, inp: StepInput, need_logits: bool = True, keep_hidden: bool = False) -> torch.Tensor | None:
        """Logits of the last token of each sequence (rank 0; None on the other ranks). A decode graph that
        samples (one GPU) returns None unless `need_logits`: its tokens are in `last_sampled`."""
        if not inp.is_prefill and not self.enforce_eager:
            return self.replay(inp, need_logits)
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

    def replay(self, inp: StepInput, need_logits: bool) -> torch.Tensor | None:
        t = self.buffers.upload_decode(inp)
        if inp.src is not None and not self.sample_in_graph:
            self.feed_pending(t["input_ids"], t["src"])
        self.graphs.replay(inp.input_ids.shape[0])
        if self.sample_in_graph and not need_logits:
            return None
        return self.model.compute_logits(self.graphs.outputs[: inp.num_seqs])

    def feed_pending(self, input_ids: torch.Tensor, src: torch.Tensor) -> None:
        """input_ids[i] = previous step's sampled token src[i] where src[i] >= 0, on the device (no sync)."""
        fed = self.last_sampled[src.clamp(min=0).long()].to(input_ids.dtype)
        torch.where(src >= 0, fed, input_ids, out=input_ids)

    # --- start-up: warm-up, KV cache, CUDA graphs --------------------------------------------------------

    def warmup_model(self) -> None:
        warmup.warmup_model(self)  # the largest prefill and sampler (engine/warmup.py)

    def warmup_attention(self) -> None:
        warmup.warmup_attention(self)  # a prefill over the cache, once the cache is there

    def allocate_kv_cache(self) -> None:
        block_bytes = kv_block_bytes(self.config, self.dtype)
        gpu = GpuMemory.measure(self.device) if self.device.type == "cuda" else None
        num_blocks = num_kvcache_blocks(self.config, block_bytes, gpu, agree=self.agree_min)
        self.config.num_kvcache_blocks = num_blocks
        self.kv_cache = allocate_zeroed(kv_cache_shape(self.config, num_blocks), self.dtype, self.device)
        for i, m in enumerate(self.attn_layers):
            m.k_cache, m.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def agree_min(self, n: int) -> int:
        """The smallest `n` over the tensor-parallel ranks (every rank must hold the same number of blocks)."""
        if self.world_size == 1:
            return n
        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def capture_cudagraph(self) -> None:
        hf = self.config.hf_config
        self.graphs = DecodeGraphs(
            max_num_seqs=self.config.max_num_seqs, hidden_size=hf.hidden_size, dtype=self.dtype, device=self.device
        )
        self.buffers.clear_decode()
        # only the first size of each kernel variant runs an eager warm-up before its capture (NOTES.md change 25)
        kv_heads = self.attn_layers[0].num_kv_heads  # this rank's, as the decode kernel sees them
        self.graphs.capture(self.decode_step, variant=lambda bs: decode_graph_variant(bs, kv_heads))

    def decode_step(self, bs: int) -> None:
        """What the decode graph of batch `bs` runs. With one GPU the whole step: feed the previous step's
        tokens, the model, the LM head, the sampler (its tokens land in `last_sampled`)."""
        v = self.buffers.decode
        # a fresh context per capture: what the layers derive from it (the page table) is made inside the graph
        set_context(
            False,
            slot_mapping=v["slot_mapping"][:bs],
            context_lens=v["context_lens"][:bs],
            block_tables=v["block_tables"][:bs],
        )
        if self.sample_in_graph:
            self.feed_pending(v["input_ids"][:bs], v["src"][:bs])
        self.graphs.outputs[:bs] = self.model(v["input_ids"][:bs], v["positions"][:bs])
        if self.sample_in_graph:
            logits = self.model.compute_logits(self.graphs.outputs[:bs])  # (bs, vocab)
            self.sampler.draw_kernels(logits, self.buffers.temperatures[:bs], out=self.last_sampled[:bs])
        reset_context()

    def exit(self) -> None:
        for m in getattr(self, "attn_layers", []):  # give the memory back (KV cache, graphs)
            m.k_cache = m.v_cache = torch.tensor([])
        for name in ("graphs", "kv_cache", "model"):
            self.__dict__.pop(name, None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        if self.group is not None:
            destroy_engine_group(self.group)
            self.group = None
