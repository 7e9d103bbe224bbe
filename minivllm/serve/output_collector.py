"""One request's outputs on their way from the thread that makes them to the coroutine that streams them
(vLLM V1's RequestOutputCollector), for AsyncLLM and the engine-core client alike."""

import asyncio
from collections.abc import AsyncIterator

from minivllm.frontend.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind

DELTA = RequestOutputKind.DELTA


def check_stream_interval(interval) -> None:
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ValueError(f"stream_interval must be an integer >= 1, got {interval!r}")


class RequestOutputCollector:
    """One request's outputs on their way to the coroutine that streams them (vLLM V1's RequestOutputCollector):
    `put_nowait` (on the event loop's thread) never keeps more than one output: when the consumer is behind, a
    DELTA output is merged into the one waiting (texts, token ids and logprobs joined), any other kind replaces it
    (it holds everything so far). So a slow client gets fewer, larger chunks instead of a growing backlog. An
    exception replaces what waits and ends the stream.

    `interval` (vLLM's `--stream-interval`, DELTA only): after the first output, the consumer is woken only once
    `interval` tokens wait, or the request finished, or it failed: a stream then costs one wake-up and one write
    per `interval` tokens instead of one per token (its first token still goes at once)."""

    __slots__ = ("delta", "output", "waiter", "interval", "held", "first")

    def __init__(self, kind: RequestOutputKind, interval: int = 1) -> None:
        check_stream_interval(interval)
        self.delta = kind == DELTA
        self.output: RequestOutput | BaseException | None = None
        self.waiter: asyncio.Future | None = None  # the consumer's, while it waits (one future, not an Event:
        # this runs for every token of every stream, and an Event's set / wait / clear cost several times more)
        self.interval = interval if self.delta else 1
        self.held = 0  # tokens in the waiting output (counted only with an interval)
        self.first = True  # the consumer has taken nothing yet

    def put_nowait(self, output: RequestOutput | BaseException) -> None:
        waiting = self.output
        if isinstance(waiting, BaseException):
            return  # the stream ends with it
        if waiting is None or not self.delta or isinstance(output, BaseException):
            self.output = output
            self.held = 0
        else:
            self.output = merge_deltas(waiting, output)
        if self.interval > 1 and not isinstance(output, BaseException):
            for c in output.outputs:
                self.held += len(c.token_ids)
        if self.waiter is not None and not self.waiter.done() and self.ready():
            self.waiter.set_result(None)

    def ready(self) -> bool:
        """Something waits that the consumer should take now."""
        out = self.output
        if out is None or self.interval == 1:
            return out is not None
        return self.first or self.held >= self.interval or isinstance(out, BaseException) or out.finished

    async def get(self) -> RequestOutput | BaseException:
        while not self.ready():
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        output, self.output = self.output, None
        self.held, self.first = 0, False
        return output

    async def outputs(self, abort, start=None) -> AsyncIterator[RequestOutput]:
        """The request's outputs up to its final one (an exception put here is raised). `start()`, if given, runs at
        the first iteration and queues the request (its error ends the iteration: nothing to abort). A consumer
        that leaves before the end (closed, cancelled, or an error) calls `abort()`, which frees its blocks."""
        if start is not None:
            start()
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
