"""The bodies of the OpenAI-compatible server's answers (openai_server.py): a request's engine streams merged
into one response, or turned into server-sent-event chunks, in OpenAI's shapes with vLLM's additions (usage in
every response, `stop_reason`, logprobs as OpenAI lays them out for completions and for chat, the prompt's
logprobs first with `echo`, and `echo` with max_tokens 0 answering the prompt scored)."""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi.responses import JSONResponse

from minivllm.frontend.outputs import CompletionOutput, RequestOutput
from minivllm.serve.http_errors import error_body, error_response, failure
from minivllm.serve.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_part
from minivllm.serve.sse import ChunkTemplate, sse


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(i, output) from several streams as they come. Leaving early closes every stream (aborting its request)."""
    if len(streams) == 1:  # the common case: no task and queue between the stream and its reader
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, end))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return dict(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


# --- the app -----------------------------------------------------------------------------------------------


class Completions:
    """One /v1/completions request: its engine streams turned into a response or into SSE chunks."""

    object, chunk_object = "text_completion", "text_completion"
    chat = False

    def __init__(self, body, rid: str, model: str, streams: list, echo: list[str] | None, tokenizer=None) -> None:
        """`streams`: (the engine stream, its meter) of each prompt; the meter is called with each output."""
        self.streams, self.meters = [s for s, _ in streams], [meter for _, meter in streams]
        self.body, self.rid, self.model, self.echo = body, rid, model, echo
        self.tokenizer = tokenizer  # decodes the first prompt token of an echo with logprobs
        self.score_only = getattr(body, "score_only", False)  # echo with max_tokens 0: the prompt, scored
        self.prompts: dict[int, RequestOutput] = {}  # prompt i's first output (its prompt logprobs)
        self.created = int(time.time())
        self.n = body.n
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.text_len: dict[int, int] = {}  # choice -> characters sent (logprobs' text offsets)

    def head(self, obj: str) -> dict:
        return dict(id=self.rid, object=obj, created=self.created, model=self.model)

    def logprobs(self, i: int, c: CompletionOutput, echo: bool):
        """The choice's logprobs: with echo, in its first chunk, the prompt's first (vLLM's shape)."""
        k, as_ids = self.body.logprobs, self.body.return_tokens_as_token_ids
        if k is None:
            return None
        index = i * self.n + c.index
        prompt = self.prompts.get(i)
        if not (echo and prompt is not None and prompt.prompt_logprobs):
            return completion_logprobs(c, k, self.text_len.get(index, 0), as_ids)
        head = prompt_logprobs_part(prompt, k, as_ids, self.tokenizer)
        tail = completion_logprobs(c, k, sum(map(len, head["tokens"])), as_ids)
        return {key: head[key] + tail[key] for key in head}

    def choice(self, i: int, c: CompletionOutput) -> dict:
        index = i * self.n + c.index
        if self.score_only:  # the one token run to score the prompt is not part of the answer
            c = replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None)
            c.finish_reason, c.stop_reason = ("length", None) if c.finish_reason else (None, None)
        echo = bool(self.echo) and index not in self.text_len  # echo: in the first chunk
        text = (self.echo[i] if echo else "") + c.text
        choice = dict(index=index, text=text, logprobs=self.logprobs(i, c, echo))
        self.text_len[index] = self.text_len.get(index, 0) + len(text)
        return dict(**choice, finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    def count(self, i: int, output: RequestOutput, first: bool) -> None:
        if first:
            self.prompts[i] = output
        self.prompt_tokens += len(output.prompt_token_ids) if first else 0
        if not self.score_only:
            for c in output.outputs:
                self.completion_tokens += len(c.token_ids)

    async def full(self) -> dict | JSONResponse:
        try:
            results: dict[int, RequestOutput] = {}
            async for i, output in merge(self.streams):
                self.meters[i](output)
                results[i] = output
        except Exception as e:  # the engine died, refused the request (400) or failed it (500)
            return error_response(str(e), *failure(e))
        finally:
            for meter in self.meters:
                meter.close()
        choices = []
        for i in sorted(results):
            self.count(i, results[i], True)
            choices += [self.choice(i, c) for c in results[i].outputs]
        return self.response(sorted(choices, key=lambda c: c["index"]))

    def response(self, choices: list[dict]) -> dict:
        return dict(**self.head(self.object), choices=choices, usage=usage(self.prompt_tokens, self.completion_tokens))

    def plain(self) -> bool:
        """The stream's chunks have the fixed shape ChunkTemplate writes (sse.py): no logprobs, no echo."""
        return self.body.logprobs is None and not self.echo and not self.score_only

    async def stream(self) -> AsyncIterator[bytes]:
        """The SSE events, one write per output (its choices' events joined): a write is a system call, the most
        a streamed token costs the API server. The last output's events go with the usage and [DONE]."""
        opts = self.body.stream_options
        continuous = bool(opts and opts.continuous_usage_stats)
        template = ChunkTemplate(self.head(self.chunk_object), self.chat) if self.plain() and not continuous else None
        seen: set[int] = set()
        single = len(self.streams) == 1  # (the common case: the stream itself, no merging layer on every token)
        source = self.streams[0] if single else merge(self.streams)
        tail, finished = [], 0
        try:
            async for item in source:
                i, output = (0, item) if single else item
                self.meters[i](output)
                first = i not in seen
                seen.add(i)
                self.count(i, output, first)
                events = self.events(i, output, first, template, continuous)
                finished += output.finished
                if finished == len(self.streams):
                    tail = events
                elif events:
                    yield b"".join(events)
            if opts and opts.include_usage:
                head = self.head(self.chunk_object)
                tail.append(sse(dict(**head, choices=[], usage=usage(self.prompt_tokens, self.completion_tokens))))
        except Exception as e:  # the stream has begun: the error is its last event
            tail.append(sse(error_body(str(e), *failure(e))))
        finally:
            for meter in self.meters:
                meter.close()
            await source.aclose()
        yield b"".join([*tail, sse("[DONE]")])

    def events(self, i: int, output: RequestOutput, first: bool, template, continuous: bool) -> list[bytes]:
        if template is not None and not (first and self.chat):  # (chat: the role first, as a dict)
            return [
                template.event(i * self.n + c.index, c.text, c.finish_reason, c.stop_reason)
                for c in output.outputs
                if c.text or c.finish_reason or (c.token_ids and not self.chat)
            ]
        chunks = self.chunks(i, output, first)
        if continuous:
            for chunk in chunks:
                chunk["usage"] = usage(self.prompt_tokens, self.completion_tokens)
        return [sse(chunk) for chunk in chunks]

    def chunks(self, i: int, output: RequestOutput, first: bool) -> list[dict]:
        return [
            dict(**self.head(self.chunk_object), choices=[self.choice(i, c)])
            for c in output.outputs
            # a chunk for every step with new tokens, as vLLM sends (their text may be empty: a partial UTF-8
            # character, a held-back stop-string prefix, or tokens that decode to nothing)
            if c.text
            or c.token_ids
            or c.finish_reason
            or c.logprobs
            or (self.echo and i * self.n + c.index not in self.text_len)
        ]


class ChatCompletions(Completions):
    """One /v1/chat/completions request: the assistant's message, or its deltas."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"
    chat = True

    def plain(self) -> bool:
        return not self.body.logprobs

    def logprobs(self, choice: int, c: CompletionOutput):
        if not self.body.logprobs:
            return None
        return chat_logprobs(c, self.body.top_logprobs or 0, self.body.return_tokens_as_token_ids)

    def choice(self, i: int, c: CompletionOutput) -> dict:
        message = dict(role="assistant", content=c.text)
        return dict(
            index=c.index,
            message=message,
            logprobs=self.logprobs(c.index, c),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def chunks(self, i: int, output: RequestOutput, first: bool) -> list[dict]:
        chunks = []
        if first:  # the role first, for every choice (OpenAI's stream starts so)
            for index in range(self.n):
                delta = dict(role="assistant", content="")
                chunks.append(
                    dict(
                        **self.head(self.chunk_object),
                        choices=[dict(index=index, delta=delta, logprobs=None, finish_reason=None)],
                    )
                )
        for c in output.outputs:
            if c.text or c.finish_reason or c.logprobs:
                choice = dict(index=c.index, delta=dict(content=c.text), logprobs=self.logprobs(c.index, c))
                choice.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                chunks.append(dict(**self.head(self.chunk_object), choices=[choice]))
        return chunks
