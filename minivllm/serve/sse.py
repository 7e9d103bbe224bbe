"""Server-sent events as the streaming endpoints write them (responses.py): `data: {json}\\n\\n`, one event per
engine step with new tokens for each choice, then `data: [DONE]`.

An event is written for every token of every stream, so its cost is the API server's cost per token. The general
path builds the chunk as a dict and encodes it (msgspec, several times faster than json.dumps). The common stream
(no logprobs, no echo, no usage in every chunk) has a fixed shape in which only the choice's index, text and finish
change: `ChunkTemplate` encodes the request's head (id, object, created, model) once and writes each event as bytes
around the JSON-encoded text, the same JSON the dict path gives.

`SSEResponse` writes the events (a lean StreamingResponse): the response's start goes through the middleware
stack (CORS headers, the error middleware's bookkeeping), each event straight to the server's own `send`, which
`capture_send` (the app's outermost layer) leaves in the scope: every middleware here looks at the start only, and
each layer skipped is a coroutine less on every token. A client that disconnects cancels the writing task (its
streams' generators close, aborting their requests), as StreamingResponse's listener does."""

import asyncio
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

_json = msgspec.json.Encoder()
NULL = b"null"


def sse(data) -> bytes:
    """One event: `data` (a dict, or a string sent as it is, "[DONE]") encoded."""
    return b"data: " + (_json.encode(data) if not isinstance(data, str) else data.encode()) + b"\n\n"


def encode(value) -> bytes:
    return NULL if value is None else _json.encode(value)


class ChunkTemplate:
    """A request's stream events of one choice each, as bytes: `head` is the chunk's fields before `choices`
    (id, object, created, model); `chat` picks the chat shape (`delta.content`) over the completion's (`text`)."""

    __slots__ = ("prefix", "before_text", "after_text")

    def __init__(self, head: dict, chat: bool) -> None:
        self.prefix = b"data: " + _json.encode(head)[:-1] + b',"choices":[{"index":'  # (the head without its "}")
        self.before_text = b',"delta":{"content":' if chat else b',"text":'
        self.after_text = b'},"logprobs":null,"finish_reason":' if chat else b',"logprobs":null,"finish_reason":'

    def event(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> bytes:
        return b"".join(
            (
                self.prefix,
                b"%d" % index,
                self.before_text,
                _json.encode(text),
                self.after_text,
                encode(finish_reason),
                b',"stop_reason":',
                encode(stop_reason),
                b"}]}\n\n",
            )
        )


RAW_SEND = "minivllm.send"  # the scope's key of the server's own send (capture_send)


def capture_send(scope: Scope, send: Send) -> None:
    """Leave the server's `send` in the scope for SSEResponse's events (called by the app's outermost layer)."""
    scope[RAW_SEND] = send


class App(FastAPI):
    """FastAPI, its outermost layer leaving the server's own `send` in the scope for the streams' events."""

    async def __call__(self, scope, receive, send) -> None:
        capture_send(scope, send)
        await super().__call__(scope, receive, send)


class SSEResponse(Response):
    """`text/event-stream` from an async iterator of events (bytes), one `http.response.body` message each."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        writer = asyncio.ensure_future(self.write(scope.get(RAW_SEND, send)))
        listener = asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait((writer, listener), return_when=asyncio.FIRST_COMPLETED)
        finally:
            writer.cancel()  # (the client left, or this task was cancelled: the events' generator closes)
            listener.cancel()
            await asyncio.gather(writer, listener, return_exceptions=True)
        if not writer.cancelled() and writer.exception() is not None:
            raise writer.exception()

    async def write(self, send: Send) -> None:
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()


async def disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
