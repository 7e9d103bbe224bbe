"""The checks of SamplingParams (sampling_params.py, plain data), run where a request is accepted (the Processor,
processor.py, for LLM and the server alike; the command line before it loads a model): each bad value is a
ValueError that names the field; on the way, vLLM's spellings are normalised in place (a stop string to a list,
top_k -1 to 0, greedy's unused filters). Integers are bounded where the engine stores them in fixed-width
tensors: a seed seeds a torch.Generator (int64, child i of n drawing from seed + i), and `n` is at most vLLM's
MAX_N. A top_k at or above the vocabulary means no limit, as in vLLM: the processor, which knows the vocabulary,
turns it off (processor.py)."""

import math

from minivllm.frontend.structured_outputs.params import StructuredOutputsParams
from minivllm.sampling_params import RequestOutputKind

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: a bias is clamped to [-100, 100]
MAX_N = 16384  # vLLM's limit of completions per prompt: each is a sequence, its state built when the request is made
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # a seed seeds an int64 generator (vLLM bounds it in its request models)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_sampling_params(sp) -> None:
    """Raise ValueError naming the first field of `sp` with a bad value; normalise the others in place."""
    if not _is_int(sp.n) or not 1 <= sp.n <= MAX_N:
        raise ValueError(f"n must be an integer >= 1 and <= {MAX_N} (vLLM's limit), got {sp.n!r}")
    if not _is_number(sp.temperature) or sp.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {sp.temperature!r}")
    if not _is_number(sp.top_p) or not 0 < sp.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {sp.top_p!r}")
    if not _is_int(sp.top_k) or sp.top_k < -1:  # -1 is vLLM's old spelling of off
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {sp.top_k!r}")
    if not _is_number(sp.min_p) or not 0 <= sp.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {sp.min_p!r}")
    if sp.seed is not None and (not _is_int(sp.seed) or not INT64_MIN <= sp.seed <= INT64_MAX - (sp.n - 1)):
        bounds = f"[{INT64_MIN}, {INT64_MAX - (sp.n - 1)}]"  # child i of n draws from seed + i
        raise ValueError(f"seed must be an integer or None, within int64 {bounds}, got {sp.seed!r}")
    if sp.max_tokens is not None and (not _is_int(sp.max_tokens) or sp.max_tokens < 1):
        raise ValueError(f"max_tokens must be an integer >= 1, got {sp.max_tokens!r}")  # or None
    if not _is_int(sp.min_tokens) or sp.min_tokens < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {sp.min_tokens!r}")
    if sp.max_tokens is not None and sp.min_tokens > sp.max_tokens:
        raise ValueError(f"min_tokens must be <= max_tokens {sp.max_tokens}, got {sp.min_tokens}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sp, name)
        if not _is_number(value) or not -2 <= value <= 2:
            raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
    if not _is_number(sp.repetition_penalty) or sp.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {sp.repetition_penalty!r}")
    if sp.logprobs is not None and (not _is_int(sp.logprobs) or not 0 <= sp.logprobs <= MAX_LOGPROBS):
        raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {sp.logprobs!r}")
    sp.stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    if not all(isinstance(s, str) and s for s in sp.stop):
        raise ValueError(f"stop must be a string or a list of non-empty strings, got {sp.stop!r}")
    sp.stop_token_ids = list(dict.fromkeys(sp.stop_token_ids or []))
    if not all(_is_int(t) for t in sp.stop_token_ids):
        raise ValueError(f"stop_token_ids must be a list of integers, got {sp.stop_token_ids!r}")
    sp.top_k = max(sp.top_k, 0)
    if sp.temperature < GREEDY_EPS:  # greedy: the filters cannot change an argmax
        sp.temperature, sp.top_p, sp.top_k, sp.min_p = 0.0, 1.0, 0, 0.0
        if sp.n > 1:
            raise ValueError(f"n must be 1 when sampling greedily (temperature 0), got {sp.n}")
    if sp.prompt_logprobs is not None and (
        not _is_int(sp.prompt_logprobs) or not 0 <= sp.prompt_logprobs <= MAX_LOGPROBS
    ):
        raise ValueError(
            f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {sp.prompt_logprobs!r}"
        )
    if sp.logit_bias is not None:
        if not isinstance(sp.logit_bias, dict) or not all(
            _is_int(t) and _is_number(b) for t, b in sp.logit_bias.items()
        ):
            raise ValueError(f"logit_bias must be a dict of token id -> finite number, got {sp.logit_bias!r}")
        sp.logit_bias = {t: max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(b))) for t, b in sp.logit_bias.items()}
    if sp.allowed_token_ids is not None:
        if not isinstance(sp.allowed_token_ids, (list, tuple)) or not all(_is_int(t) for t in sp.allowed_token_ids):
            raise ValueError(f"allowed_token_ids must be a list of integers, got {sp.allowed_token_ids!r}")
        if not sp.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        sp.allowed_token_ids = list(sp.allowed_token_ids)
    if sp.bad_words is not None:
        if not isinstance(sp.bad_words, (list, tuple)) or not all(
            isinstance(w, str) and w.strip() for w in sp.bad_words
        ):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {sp.bad_words!r}")
        sp.bad_words = list(sp.bad_words)
    if sp.output_kind not in tuple(RequestOutputKind):
        raise ValueError(f"output_kind must be a RequestOutputKind, got {sp.output_kind!r}")
    sp.output_kind = RequestOutputKind(sp.output_kind)
    so = sp.structured_outputs
    if so is not None and not isinstance(so, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, got {type(so).__name__}")
