"""The API server's side of each request (vLLM V1's OutputProcessor): the core's per-step token ids become
RequestOutputs here, in the front-end process. Each sequence detokenises incrementally and looks for its stop
strings (detokenizer.py); one that hits a stop string is finished here and aborted in the core. A request of
`n` completions is `n` core requests (children `i_<id>`, child i seeded seed + i as the offline engine does),
merged back into one RequestOutput per step, in the request's output kind (DELTA for streams)."""

import asyncio
import time
from dataclasses import dataclass, field, replace

from minivllm.engine.detokenizer import Detokenizer
from minivllm.engine.messages import RequestStep
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

FINAL_ONLY, DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA


@dataclass(slots=True)
class Child:
    """One sequence of a request (one core request)."""

    index: int
    params: SamplingParams
    detokenizer: Detokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_chars: int = 0


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, Child]  # core request id -> child
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


def make_state(request_id, prompt, prompt_token_ids, params, tokenizer, loop, queue) -> RequestState:
    """The request's state, its children's ids and params (n == 1 each, the engine's seeds per child)."""
    children = {}
    for i in range(params.n):
        seed = params.seed + i if params.n > 1 and params.seed is not None else params.seed
        child = replace(params, n=1, seed=seed)
        detok = Detokenizer(tokenizer, child) if child.stop or child.output_kind != FINAL_ONLY else None
        cid = request_id if params.n == 1 else f"{i}_{request_id}"
        children[cid] = Child(i, child, detok, logprobs=[] if child.logprobs is not None else None)
    return RequestState(request_id, prompt, prompt_token_ids, params, children, loop, queue)


def update(child: Child, step: RequestStep) -> bool:
    """Apply one step to a child; True when a stop string ended it here (the core must drop it)."""
    child.token_ids += step.new_token_ids
    if child.logprobs is not None and step.new_logprobs:
        for entries in step.new_logprobs:
            child.logprobs.append({t: Logprob(lp, rank, text) for t, lp, rank, text in entries})
            child.cumulative_logprob += entries[0][1]
    done = step.finish_reason is not None
    stopped = False
    if child.detokenizer is not None and (step.new_token_ids or done):
        stop = child.detokenizer.add(child.token_ids, final=done)
        if stop is not None:
            stopped = not done
            child.finish_reason, child.stop_reason = "stop", stop
            done = True
    if not stopped and step.finish_reason is not None:
        child.finish_reason = child.finish_reason or step.finish_reason
        child.stop_reason = child.stop_reason if child.stop_reason is not None else step.stop_reason
    return stopped


def completion(child: Child, tokenizer) -> CompletionOutput:
    done = child.finish_reason is not None
    if child.detokenizer is not None:
        text = child.detokenizer.visible(done)
    else:  # FINAL_ONLY without stop strings: decoded once, at the end
        text = tokenizer.decode(child.token_ids, skip_special_tokens=child.params.skip_special_tokens)
    return CompletionOutput(
        index=child.index,
        text=text,
        token_ids=list(child.token_ids),
        cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
        logprobs=list(child.logprobs) if child.logprobs is not None else None,
        finish_reason=child.finish_reason,
        stop_reason=child.stop_reason,
    )


def request_output(state: RequestState, changed: list[Child], tokenizer) -> RequestOutput | None:
    """The request's output after a step in which `changed` got tokens (requests.py's rules: nothing while a
    FINAL_ONLY request runs; DELTA: only what is new)."""
    kind, finished = state.params.output_kind, state.finished
    if kind == FINAL_ONLY and not finished:
        return None
    if kind != DELTA:
        completions = [completion(c, tokenizer) for c in sorted(state.children.values(), key=lambda c: c.index)]
    else:
        completions = []
        for child in sorted(changed, key=lambda c: c.index):
            c = completion(child, tokenizer)
            tokens, chars = child.num_sent_tokens, child.num_sent_chars
            child.num_sent_tokens, child.num_sent_chars = len(c.token_ids), len(c.text)
            c.token_ids, c.text = c.token_ids[tokens:], c.text[chars:]
            c.logprobs = c.logprobs[tokens:] if c.logprobs is not None else None
            completions.append(c)
        if not completions and not finished:
            return None
    return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, finished)
