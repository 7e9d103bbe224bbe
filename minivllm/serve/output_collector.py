"""One request's outputs on their way from the thread that makes them to the coroutine that streams them
(vLLM V1's RequestOutputCollector), for AsyncLLM and the engine-core client alike."""

import asyncio
from collections.abc import AsyncIterator

from minivllm.frontend.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind

DELTA = RequestOutputKind.DELTA


class RequestOutputCollector:
    """One request's outputs on their way to the coroutine that streams them (vLLM V1's RequestOutputCollector):
    `put_nowait` (on the event loop's thread) never keeps more than one output: when the consumer is behind, a
    DELTA output is merged into the one waiting (texts, token ids and logprobs joined), any other kind replaces it
    (it holds everything so far). So a slow client gets fewer, larger chunks instead of a growing backlog. An
    exception replaces what waits and ends the stream."""

    __slots__ = ("delta", "output", "waiter")

    def __init__(self, kind: RequestOutputKind) -> None:
        self.delta = kind == DELTA
        self.output: RequestOutput | BaseException | None = None
        self.waiter: asyncio.Future | None = None  # the consumer's, while it waits (one future, not an Event:
        # this runs for every token of every stream, and an Event's set / wait / clear cost several times more)

    def put_nowait(self, output: RequestOutput | BaseException) -> None:
        waiting = self.output
        if isinstance(waiting, BaseException):
            return  # the stream ends with it
        if waiting is None or not self.delta or isinstance(output, BaseException):
            self.output = output
        else:
            self.output = merge_deltas(waiting, output)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        while self.output is None:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        output, self.output = self.output, None
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
