"""The engine loop (nano-vllm's llm_engine.py): add requests, step until done. Requests are validated at
add_request, so a bad one is refused with a clear error and never enters the queue."""

import atexit
import time
import weakref
from dataclasses import dataclass, field

from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig

from minivllm.config import Config
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence
from minivllm.engine.tp_workers import Workers
from minivllm.sampling_params import SamplingParams
from minivllm.utils.dist import free_port


@dataclass(slots=True)
class StepRecord:
    """Where one step's wall time went (host seconds; `run` includes the GPU work, which it waits for)."""

    is_prefill: bool
    num_seqs: int
    num_tokens: int
    schedule: float
    run: float
    postprocess: float


@dataclass(slots=True)
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    request_id: int = -1
    outputs: list = field(default_factory=list)  # vLLM's shape: outputs[0].text, filled with self

    def __post_init__(self) -> None:
        self.outputs = [self]


def eos_token_ids(model: str, tokenizer) -> list[int]:
    ids = set()
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


class LLMEngine:
    def __init__(self, model: str, **kwargs) -> None:
        config = Config.from_engine_args(model, **kwargs)
        self.config = config
        port = free_port()
        self.workers = Workers(config, port) if config.tensor_parallel_size > 1 else None
        try:
            self.model_runner = ModelRunner(config, rank=0, port=port, workers=self.workers)
        except BaseException:
            if self.workers is not None:  # a failed start leaves no process behind
                self.workers.exit(timeout=1)
            raise
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.eos = eos_token_ids(model, self.tokenizer)
        self.scheduler = Scheduler(config, self.eos)
        self.vocab_size = config.hf_config.vocab_size
        self.prompts: dict[int, str | None] = {}
        self.step_log: list[StepRecord] = []
        this = weakref.ref(self)  # at exit, stop the workers of an engine still alive
        self._atexit = lambda: this() is not None and this().exit()
        atexit.register(self._atexit)

    def exit(self) -> None:
        if getattr(self, "model_runner", None) is None:
            return
        atexit.unregister(self._atexit)
        if self.workers is not None:
            self.workers.exit()
            self.workers = None
        self.model_runner.exit()
        self.model_runner = None

    # --- requests --------------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def check_request(self, token_ids: list[int], sp: SamplingParams) -> None:
        c = self.config
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(sp).__name__}")
        if len(token_ids) == 0:
            raise ValueError("empty prompt: a request needs at least one token")
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        total = len(token_ids) + sp.max_tokens
        if total > c.max_model_len:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens + max_tokens {sp.max_tokens} = {total} exceeds "
                f"max_model_len {c.max_model_len}"
            )
        blocks = (total + c.kvcache_block_size - 1) // c.kvcache_block_size
        if blocks > c.num_kvcache_blocks:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens + max_tokens {sp.max_tokens} needs {blocks} KV blocks; "
                f"the cache has only {c.num_kvcache_blocks}"
            )

    def add_request(
        self, prompt: str | list[int], sampling_params: SamplingParams, token_ids: list[int] | None = None
    ) -> int:
        token_ids = token_ids if token_ids is not None else self.tokenize(prompt)
        self.check_request(token_ids, sampling_params)
        seq = Sequence(token_ids, sampling_params)
        self.prompts[seq.seq_id] = prompt if isinstance(prompt, str) else None
        self.scheduler.add(seq)
        return seq.seq_id

    # --- the loop --------------------------------------------------------------------------------------

    def _launch(self) -> tuple | None:
        """Schedule one step and launch it without waiting. None when nothing can be scheduled now."""
        t0 = time.perf_counter()
        seqs = self.scheduler.schedule()
        if not seqs:
            return None
        is_prefill = any(s.num_scheduled_tokens != 1 or s.num_computed_tokens != s.num_tokens - 1 for s in seqs)
        record = StepRecord(is_prefill, len(seqs), sum(s.num_scheduled_tokens for s in seqs), 0.0, 0.0, 0.0)
        t1 = time.perf_counter()
        handle = self.model_runner.launch(seqs, is_prefill)
        sampled = self.scheduler.on_launch(seqs)
        record.schedule, record.run = t1 - t0, time.perf_counter() - t1
        return seqs, sampled, handle, record

    def _finish(self, launched: tuple) -> list[Sequence]:
        """Wait for a launched step's tokens and account them. Returns the sequences that finished."""
        seqs, sampled, handle, record = launched
        t = time.perf_counter()
        finished = self.scheduler.on_result(seqs, sampled, handle.result())
        record.postprocess = time.perf_counter() - t
        self.step_log.append(record)
        return finished

    def step(self) -> tuple[list[Sequence], int, bool]:
        """One step, waited for. Returns (finished sequences, tokens computed, whether it was a prefill step)."""
        launched = self._launch()
        if launched is None:
            raise RuntimeError("scheduler produced an empty step while requests are pending")
        record = launched[3]
        return self._finish(launched), record.num_tokens, record.is_prefill

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            self.prompts.pop(seq.seq_id, None),
            seq.prompt_token_ids,
            self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True),
            seq.completion_token_ids,
            seq.finish_reason,
            seq.seq_id,
        )

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        token_ids = [self.tokenize(p) for p in prompts]
        problems = []
        for i, (ids, sp) in enumerate(zip(token_ids, sampling_params)):
            try:
                self.check_request(ids, sp)
            except (ValueError, TypeError) as e:
                problems.append(f"prompt {i}: {e}")
        if problems:  # refuse the batch before anything is queued
            raise ValueError("; ".join(problems))
        seq_ids = [self.add_request(p, sp, ids) for p, sp, ids in zip(prompts, sampling_params, token_ids)]
        outputs: dict[int, RequestOutput] = {}
        pbar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        t0, tokens = time.perf_counter(), {True: 0, False: 0}  # computed tokens: prefill, decode
        for finished in self.run_until_done():
            for seq in finished:
                outputs[seq.seq_id] = self.output(seq)
            pbar.update(len(finished))
            if use_tqdm:
                record, dt = self.step_log[-1], max(time.perf_counter() - t0, 1e-9)
                tokens[record.is_prefill] += record.num_tokens
                pbar.set_postfix(
                    prefill=f"{tokens[True] / dt:.0f}tok/s", decode=f"{tokens[False] / dt:.0f}tok/s", refresh=False
                )
        pbar.close()
        return [outputs[i] for i in seq_ids]

    def run_until_done(self):
        """Step until every request has finished, yielding the sequences finished at each step.

        With one GPU the loop runs one step ahead: step N+1 is scheduled, prepared and launched while step N
        runs, its sampled tokens fed on the device (placeholders on the host), and step N's tokens are read
        back only afterwards. The host work of a step hides behind the GPU work of the previous one. With
        tensor parallelism the workers need the tokens on the host, so each step waits for its own."""
        overlap = self.config.tensor_parallel_size == 1
        in_flight = None  # a launched step whose tokens are not read yet
        while not self.scheduler.is_finished() or in_flight:
            launched = self._launch() if not self.scheduler.is_finished() else None
            if launched is None and in_flight is None:
                raise RuntimeError("scheduler produced an empty step while requests are pending")
            if not overlap and launched:
                in_flight, launched = launched, None
            if in_flight:
                yield self._finish(in_flight)
            in_flight = launched
