"""Server-sent events as the streaming endpoints write them (responses.py): `data: {json}\\n\\n`, one event per
engine step with new tokens for each choice, then `data: [DONE]`.

An event is written for every token of every stream, so its cost is the API server's cost per token. The general
path builds the chunk as a dict and encodes it (msgspec, several times faster than json.dumps). The common stream
(no logprobs, no echo, no usage in every chunk) has a fixed shape in which only the choice's index, text and finish
change: `ChunkTemplate` encodes the request's head (id, object, created, model) once and writes each event as bytes
around the JSON-encoded text, the same JSON the dict path gives."""

import msgspec

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
