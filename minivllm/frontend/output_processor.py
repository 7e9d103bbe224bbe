"""The API server's side of each request (vLLM V1's OutputProcessor): the core's per-step token ids become
RequestOutputs here, in the front-end process. Each sequence detokenises incrementally and looks for its stop
strings (detokenizer.py); one that hits a stop string is finished here and aborted in the core. A request of
`n` completions is `n` core requests (children `i_<id>`, child i seeded seed + i as the offline engine does),
merged back into one RequestOutput per step, in the request's output kind (DELTA for streams). What an output
holds follows the offline engine's rules (requests.py: `completions_of`, `text_token_ids`)."""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from minivllm.frontend.detokenizer import Detokenizer
from minivllm.frontend.outputs import Logprob, PromptLogprobs, RequestOutput
from minivllm.frontend.requests import completions_of, text_token_ids
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.serve.messages import RequestStep

FINAL_ONLY, DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA


@dataclass(slots=True)
class Child:
    """One sequence of a request (one core request), with the attributes requests.py's output rules read."""

    index: int
    sampling_params: SamplingParams
    detokenizer: Detokenizer | None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_chars: int = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


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
    prompt_logprobs: PromptLogprobs | None = None  # from the core, once the prompt is scored
    prompt_logprobs_sent: bool = False  # DELTA: sent with the first output that has them

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


def _entries(entries: list[tuple]) -> dict[int, Logprob]:
    return {t: Logprob(lp, rank, text) for t, lp, rank, text in entries}


def update(state: RequestState, child: Child, step: RequestStep) -> bool:
    """Apply one step to a child; True when a stop string ended it here (the core must drop it)."""
    if step.prompt_logprobs is not None and state.prompt_logprobs is None:
        state.prompt_logprobs = [None if e is None else _entries(e) for e in step.prompt_logprobs]
    child.output_token_ids += step.new_token_ids
    if child.logprobs is not None and step.new_logprobs:
        for entries in step.new_logprobs:
            child.logprobs.append(_entries(entries))
            child.cumulative_logprob += entries[0][1]
    done = step.finish_reason is not None
    stopped = False
    if child.detokenizer is not None and (step.new_token_ids or done):
        stop = child.detokenizer.add(text_token_ids(child, step.finish_reason, step.stop_reason), final=done)
        if stop is not None:
            stopped = not done
            child.finish_reason, child.stop_reason = "stop", stop
            done = True
    if not stopped and step.finish_reason is not None:
        child.finish_reason = child.finish_reason or step.finish_reason
        child.stop_reason = child.stop_reason if child.stop_reason is not None else step.stop_reason
    return stopped


def request_output(state: RequestState, changed: list[Child], tokenizer) -> RequestOutput | None:
    """The request's output after a step in which `changed` got tokens (requests.py's rules: nothing while a
    FINAL_ONLY request runs; DELTA: only what is new)."""
    kind, finished = state.params.output_kind, state.finished
    if kind == FINAL_ONLY and not finished:
        return None
    completions = completions_of(list(state.children.values()), changed, kind, tokenizer)
    if kind == DELTA and not completions and not finished:
        return None
    prompt_logprobs = None if kind == DELTA and state.prompt_logprobs_sent else state.prompt_logprobs
    state.prompt_logprobs_sent = state.prompt_logprobs is not None
    return RequestOutput(
        state.request_id, state.prompt, state.prompt_token_ids, completions, finished, prompt_logprobs=prompt_logprobs
    )


class RequestOutputCollector:
    """One request's outputs on their way to the coroutine that streams them (vLLM V1's RequestOutputCollector):
    `put_nowait` (on the event loop's thread) never keeps more than one output: when the consumer is behind, a
    DELTA output is merged into the one waiting (texts, token ids and logprobs joined), any other kind replaces it
    (it holds everything so far). So a slow client gets fewer, larger chunks instead of a growing backlog. An
    exception replaces what waits and ends the stream."""

    __slots__ = ("delta", "output", "ready")

    def __init__(self, kind: RequestOutputKind) -> None:
        self.delta = kind == DELTA
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put_nowait(self, output: RequestOutput | BaseException) -> None:
        waiting = self.output
        if isinstance(waiting, BaseException):
            return  # the stream ends with it
        if waiting is None or not self.delta or isinstance(output, BaseException):
            self.output = output
        else:
            self.output = merge_deltas(waiting, output)
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while self.output is None:
            await self.ready.wait()
        output, self.output = self.output, None
        self.ready.clear()
        return output

    async def outputs(self, abort) -> AsyncIterator[RequestOutput]:
        """The request's outputs up to its final one (an exception put here is raised). A consumer that leaves
        before the end (closed, cancelled, or an error) calls `abort()`, which frees the request's blocks."""
        finished = False
        try:
            while not finished:
                item = await self.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                abort()


def merge_deltas(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Two DELTA outputs of one request, `new` after `old`, as one: each sequence's new text, token ids and
    logprobs joined, its finish reason the latest."""
    by_index = {c.index: c for c in old.outputs}
    for c in new.outputs:
        o = by_index.get(c.index)
        if o is None:
            by_index[c.index] = c
            continue
        o.text += c.text
        o.token_ids = o.token_ids + c.token_ids
        if o.logprobs is not None and c.logprobs is not None:
            o.logprobs = o.logprobs + c.logprobs
        o.cumulative_logprob = c.cumulative_logprob
        o.finish_reason, o.stop_reason = c.finish_reason, c.stop_reason
    old.outputs = sorted(by_index.values(), key=lambda c: c.index)
    old.finished = new.finished
    if old.prompt_logprobs is None:
        old.prompt_logprobs = new.prompt_logprobs
    return old
