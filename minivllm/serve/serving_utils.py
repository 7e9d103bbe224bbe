"""Small pieces of the server's handlers (openai_server.py): a bad request's 400 (or 404) naming the field it is
about, and running a handler until its client disconnects."""

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minivllm.serve.http_errors import error_response
from minivllm.serve.protocol import ChatCompletionRequest, CompletionRequest

FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | {"logprobs", "top_k"}


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def param_of(message: str, prompt: str) -> str | None:
    """The request field an error is about: SamplingParams' messages start with it; the engine's are about
    the prompt (named `prompt`: "prompt" or "messages") or its length with max_tokens."""
    if message.startswith("prompt of"):
        return "max_tokens" if "max_tokens" in message else prompt
    first = message.split(" ", 1)[0]
    if first in FIELDS:
        return first
    return prompt if any(w in message for w in ("prompt", "token ids")) else None


def bad_request(e: Exception, prompt: str = "prompt") -> JSONResponse:
    if isinstance(e, BadRequest):
        return error_response(str(e), e.param, e.status)
    return error_response(str(e), param_of(str(e), prompt))


async def until_disconnect(request: Request, work):
    """Run the coroutine `work`; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:  # the client is gone: nobody reads this
        return Response(status_code=499)
