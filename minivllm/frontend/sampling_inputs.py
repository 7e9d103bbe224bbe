"""One step's sampling parameters, built on the host from the scheduled sequences and put on the device
(as step_inputs.py does for the model's inputs). Only what some row of the batch uses is built: the common
batch (temperature only) is one upload of temperatures, which the decode graph's sampler reads in place;
penalties, min_tokens, seeds, filters and logprobs add their tensors only when a row asks for them, and
then the step samples outside the graph (`SamplingInputs.plain` is False).

The pipeline a request's SamplingParams drive, in order (`sample_tokens` below): log-probabilities
of the raw logits (`logprobs`), `min_tokens` (EOS and `stop_token_ids` masked until reached), the penalties
(`repetition_penalty` over prompt + output tokens, `frequency_penalty` / `presence_penalty` over output
tokens), then temperature, `min_p`, `top_k`, `top_p`, and the draw (`seed`: the request's own random stream).
On the host: `stop` strings on the detokenised text, `max_tokens`, `ignore_eos`. Before the penalties,
`allowed_token_ids`, `bad_words` and `logit_bias` (frontend/logits_processors.py). `structured_outputs` masks the
logits before all of these, logprobs included as in vLLM (structured_outputs/)."""

from dataclasses import dataclass, field

import torch

from minivllm.engine.sequence import PENDING, Sequence
from minivllm.engine.step_inputs import InputBuffers
from minivllm.frontend.logits_processors import LogitsEdits, apply_logits_edits, bad_word_bans
from minivllm.frontend.logprobs import LogprobsTensors, add_sampled, raw_logprobs
from minivllm.frontend.penalties import apply_penalties, ban_tokens, has_penalties, needs_history, token_counts
from minivllm.frontend.sampling_filters import sample
from minivllm.frontend.structured_outputs.bitmask import GrammarMask, apply_grammar_mask, grammar_mask
from minivllm.layers.sampler import Sampler
from minivllm.sampling_params import SamplingParams


def needs_processing(sp: SamplingParams) -> bool:
    """Anything beyond temperature: the row is sampled outside the decode graph, by the sampling hook."""
    return (
        sp.top_k > 0
        or sp.top_p < 1
        or sp.min_p > 0
        or needs_history(sp)
        or (sp.seed is not None and sp.temperature > 0)
        or sp.logprobs is not None
        or bool(sp.logit_bias or sp.allowed_token_ids)
        or sp.structured_outputs is not None  # the grammar's mask, on the eager path
    )


@dataclass(slots=True)
class Penalties:
    rows: torch.Tensor  # (P,) int64, the penalised rows of the batch
    output_counts: torch.Tensor  # (P, V) float32, count of each token in the row's output
    prompt_mask: torch.Tensor  # (P, V) bool, token occurs in the prompt
    presence: torch.Tensor  # (P,) float32
    frequency: torch.Tensor  # (P,) float32
    repetition: torch.Tensor  # (P,) float32


@dataclass(slots=True)
class SamplingInputs:
    temperatures: torch.Tensor | None = None  # (B,) float32, 0 = greedy; None: every row greedy
    top_ks: torch.Tensor | None = None  # (B,) int32, 0 = off; None: no row filters (and top_ps, min_ps None)
    top_ps: torch.Tensor | None = None  # (B,) float32, 1 = off
    min_ps: torch.Tensor | None = None  # (B,) float32, 0 = off; None: no row uses min_p
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) (K,) int64 set to -inf (min_tokens)
    penalties: Penalties | None = None
    edits: LogitsEdits | None = None  # allowed_token_ids, bad_words, logit_bias (layers/logits_processors.py)
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> its request's own generator
    logprob_rows: list[int] = field(default_factory=list)  # rows that asked for logprobs
    num_logprobs: int = 0  # top-k of those rows (the largest asked; each row keeps its own k on the host)
    grammar: GrammarMask | None = None  # the token bitmask of the rows with structured outputs

    @property
    def plain(self) -> bool:
        """Temperature only: the decode graph's one-pass sampler draws these tokens."""
        return (
            self.top_ks is None
            and self.min_ps is None
            and self.banned is None
            and self.penalties is None
            and self.edits is None
            and not self.generators
            and not self.logprob_rows
            and self.grammar is None
        )


def generator_of(seq: Sequence, device: torch.device) -> torch.Generator:
    """The sequence's own random stream, seeded from its request (made at its first draw)."""
    if seq.generator is None:
        seq.generator = torch.Generator(device=device).manual_seed(seq.sampling_params.seed)
    return seq.generator


def prepare_sampling(
    seqs: list[Sequence],
    buffers: InputBuffers,
    *,
    device: torch.device,
    eos: list[int],
    vocab: int,
    in_graph: bool = False,
) -> SamplingInputs | None:
    """The step's SamplingInputs, or None when no row needs more than its temperature. `in_graph`: the decode
    graph samples, so it reads temperatures even when every row is greedy."""
    sps = [s.sampling_params for s in seqs]
    extra = [  # rows that need more than temperature (min_tokens only until reached)
        i
        for i, (s, sp) in enumerate(zip(seqs, sps))
        if needs_processing(sp) or (sp.min_tokens and sp.min_tokens > s.num_completion_tokens)
    ]
    if not extra:  # temperatures only: the core samples these rows (model_runner.py: prepare_sample)
        return None
    greedy = all(sp.temperature == 0 for sp in sps)
    out = SamplingInputs()
    filtering = any(sps[i].top_k > 0 or sps[i].top_p < 1 or sps[i].min_p > 0 for i in extra)
    temperatures, out.top_ps = buffers.upload_floats(
        [sp.temperature for sp in sps], [sp.top_p for sp in sps] if filtering else None
    )
    out.temperatures = None if greedy and not in_graph else temperatures
    ints = lambda values: to_device(values, torch.int64, device)
    floats = lambda values: to_device(values, torch.float32, device)
    if filtering:
        out.top_ks = ints([min(sp.top_k, vocab) for sp in sps])  # (B,) a top_k beyond the vocabulary keeps all
        if any(sps[i].min_p > 0 for i in extra):
            out.min_ps = floats([sp.min_p for sp in sps])
    banned = [
        (i, t)
        for i in extra
        if seqs[i].num_completion_tokens < sps[i].min_tokens
        for t in dict.fromkeys([*eos, *sps[i].stop_token_ids])
    ]
    if banned:
        out.banned = ints([i for i, _ in banned]), ints([t for _, t in banned])
    out.edits = logits_edits(seqs, extra, device)
    penalised = [i for i in extra if has_penalties(sps[i])]
    if penalised:
        out.penalties = penalties([seqs[i] for i in penalised], penalised, vocab, device)
    out.generators = {  # a prefill chunk that does not finish its prompt draws nothing from its stream
        i: generator_of(seqs[i], device)
        for i in extra
        if sps[i].seed is not None and sps[i].temperature > 0 and finishes_prompt(seqs[i])
    }
    out.logprob_rows = [i for i in extra if sps[i].logprobs is not None]
    out.num_logprobs = max((sps[i].logprobs for i in out.logprob_rows), default=0)
    out.grammar = grammar_mask(seqs, vocab, device)  # structured outputs (minivllm/frontend/structured_outputs)
    return out


def failing_requests(seqs: list[Sequence], prepare_inputs, buffers: InputBuffers, **kwargs) -> dict[str, Exception]:
    """The requests whose sequences fail alone: each sequence's step inputs (`prepare_inputs([seq])`) and sampling
    inputs (prepare_sampling's `kwargs`) prepared as a batch of one; request id -> its first error. The engine asks
    when a step failed to launch, to end those requests and launch the others (llm_engine.py)."""
    failing: dict[str, Exception] = {}
    for seq in seqs:
        try:
            prepare_inputs([seq])
            prepare_sampling([seq], buffers, **kwargs)
        except Exception as e:
            failing.setdefault(seq.request_id, e)
    return failing


def logits_edits(seqs: list[Sequence], rows: list[int], device: torch.device) -> LogitsEdits | None:
    """The (row, token) pairs that allowed_token_ids, bad_words and logit_bias touch in `rows` (None: none)."""
    ints = lambda values: to_device(values, torch.int64, device)
    e, allowed_rows, allowed, bias, banned = LogitsEdits(), [], [], [], []
    for i in rows:
        sp = seqs[i].sampling_params
        if sp.allowed_token_ids:
            allowed_rows.append(i)
            allowed += [(i, t) for t in sp.allowed_token_ids]
        if sp.bad_words_token_ids:
            output = seqs[i].completion_token_ids
            assert PENDING not in output, "bad words need every previous token: finish the step in flight first"
            banned += [(i, t) for t in bad_word_bans(output, sp.bad_words_token_ids)]
        bias += [(i, t, b) for t, b in (sp.logit_bias or {}).items()]
    if allowed:
        e.allowed_rows, e.allowed = ints(allowed_rows), (ints([i for i, _ in allowed]), ints([t for _, t in allowed]))
    if banned:
        e.banned = ints([i for i, _ in banned]), ints([t for _, t in banned])
    if bias:
        biases = to_device([b for _, _, b in bias], torch.float32, device)
        e.bias = ints([i for i, _, _ in bias]), ints([t for _, t, _ in bias]), biases
    return e if allowed or banned or bias else None


def finishes_prompt(seq: Sequence) -> bool:
    """This step computes the sequence's last token, so its sampled token is kept."""
    return seq.num_computed_tokens + seq.num_scheduled_tokens >= seq.num_tokens


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def penalties(seqs: list[Sequence], rows: list[int], vocab: int, device: torch.device) -> Penalties:
    """Token counts of the penalised sequences (at batch `rows`), built on the device from their token ids.
    Every token must be known: the engine finishes the step in flight before it launches a step with
    penalties (llm_engine.py)."""
    out_rows, out_ids, prompt_rows, prompt_ids = [], [], [], []
    for j, s in enumerate(seqs):
        output = s.completion_token_ids
        assert PENDING not in output, "penalties need every previous token: finish the step in flight first"
        out_rows += [j] * len(output)
        out_ids += output
        prompt_rows += [j] * s.num_prompt_tokens
        prompt_ids += s.prompt_token_ids
    ints = lambda values: to_device(values, torch.int64, device)
    floats = lambda values: to_device([getattr(s.sampling_params, values) for s in seqs], torch.float32, device)
    prompt_mask = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=device)
    prompt_mask[ints(prompt_rows), ints(prompt_ids)] = True
    return Penalties(
        rows=ints(rows),
        output_counts=token_counts(ints(out_rows), ints(out_ids), len(seqs), vocab),
        prompt_mask=prompt_mask,
        presence=floats("presence_penalty"),
        frequency=floats("frequency_penalty"),
        repetition=floats("repetition_penalty"),
    )


@torch.inference_mode()
def sample_tokens(
    sampler: Sampler, logits: torch.Tensor, s: SamplingInputs
) -> tuple[torch.Tensor, LogprobsTensors | None]:
    """Tokens (B,) int64 from the step's logits (B, V), in vLLM's order: the grammars' mask, raw logprobs,
    allowed tokens, bad words and logit bias, min_tokens, penalties, then the sampler (temperature, filters, the
    draw; seeded rows from their own streams)."""
    if s.grammar is not None:
        apply_grammar_mask(logits, s.grammar)  # in place: disallowed tokens -inf
    logprobs = None
    if s.logprob_rows:
        raw, logprobs = raw_logprobs(logits, s.logprob_rows, s.num_logprobs)
    if s.banned is not None or s.penalties is not None or s.edits is not None:
        logits = logits.float()  # (B, V), changed in place below
        if s.edits is not None:
            apply_logits_edits(logits, s.edits)
        if s.banned is not None:
            ban_tokens(logits, *s.banned)
        if (p := s.penalties) is not None:
            logits[p.rows] = apply_penalties(
                logits[p.rows], p.output_counts, p.prompt_mask, p.presence, p.frequency, p.repetition
            )
    tokens = sample(sampler, logits, s.temperatures, s.top_ks, s.top_ps, min_ps=s.min_ps, generators=s.generators)
    if logprobs is not None:
        add_sampled(logprobs, raw, tokens)
    return tokens, logprobs
