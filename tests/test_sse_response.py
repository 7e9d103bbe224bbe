"""SSEResponse (serve/sse.py): the response's start through the middleware stack's send, each event through the
server's own send left in the scope, and a client that disconnects closes the events' generator (which aborts
the request behind it)."""

import asyncio

from minivllm.serve.sse import RAW_SEND, SSEResponse, capture_send


def run(events, receive, scope: dict | None = None):
    chain, raw = [], []

    async def chain_send(message):
        chain.append(message)

    async def raw_send(message):
        raw.append(message)
        await asyncio.sleep(0)

    scope = {"type": "http"} if scope is None else scope
    capture_send(scope, raw_send)
    asyncio.run(SSEResponse(events)(scope, receive, chain_send))
    return chain, raw


async def never_disconnects():
    await asyncio.Event().wait()


def test_the_start_goes_through_the_stack_and_the_events_straight_to_the_server():
    async def events():
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"

    chain, raw = run(events(), never_disconnects)
    assert [m["type"] for m in chain] == ["http.response.start"]
    assert (b"content-type", b"text/event-stream; charset=utf-8") in chain[0]["headers"]
    assert [(m["body"], m["more_body"]) for m in raw] == [(b"data: 1\n\n", True), (b"data: 2\n\n", True), (b"", False)]


def test_without_the_servers_send_in_the_scope_everything_goes_through_the_stack():
    async def events():
        yield b"data: 1\n\n"

    chain = []

    async def send(message):
        chain.append(message)

    asyncio.run(SSEResponse(events())({"type": "http"}, never_disconnects, send))
    assert [m["type"] for m in chain] == ["http.response.start", "http.response.body", "http.response.body"]
    assert RAW_SEND == "minivllm.send"


def test_a_client_that_disconnects_closes_the_events_generator():
    closed = []

    async def events():
        try:
            yield b"data: 1\n\n"
            await asyncio.Event().wait()  # the next token never comes
            yield b"data: 2\n\n"
        finally:
            closed.append(True)

    async def disconnect():
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    chain, raw = run(events(), disconnect)
    assert closed == [True]
    assert [m["body"] for m in raw] == [b"data: 1\n\n"]  # no end of body: the client is gone


def test_an_error_while_writing_is_raised():
    async def events():
        yield b"data: 1\n\n"
        raise RuntimeError("boom")

    try:
        run(events(), never_disconnects)
    except RuntimeError as e:
        assert str(e) == "boom"
    else:
        raise AssertionError("the error was swallowed")
