"""Tokenising, chat templates and detokenising off the server's event loop: a small pool of processes, each
with its own copy of the tokenizer (vLLM's front end keeps this work off its loop too).

Why processes and not threads: the fast tokenizer releases the GIL while it splits the text, but turning
its ids into a Python list holds it; a 5 MB prompt (~4 million ids) on two cores kept the loop from running
for ~0.5 s in a thread, ~9 s inline. In another process nothing of it touches the loop's GIL, and a prompt
longer than the model can take is refused there: its ids never travel back."""

import asyncio
import concurrent.futures
import multiprocessing as mp
import os
import threading
import time

from minivllm.utils.process_name import TOKENIZER, set_process_name

_tokenizer = None  # the worker process's own


def _load(model: str, tokenizer: str, parent: int) -> None:
    global _tokenizer
    from transformers import AutoConfig

    from minivllm.checkpoint import load_tokenizer

    set_process_name(TOKENIZER)
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    _tokenizer = load_tokenizer(tokenizer, AutoConfig.from_pretrained(model))


def _exit_with(parent: int) -> None:
    """A worker blocked in its queue does not notice a killed server: it leaves once its parent is gone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _fits(ids: list[int], max_model_len: int) -> list[int]:
    from minivllm.frontend.processor import no_room  # the engine's words: the server names the field from them

    if len(ids) >= max_model_len:
        raise ValueError(no_room(len(ids), max_model_len))
    return ids


def _encode(text: str, max_model_len: int, add_special_tokens: bool) -> list[int]:
    return _fits(_tokenizer.encode(text, add_special_tokens=add_special_tokens), max_model_len)


def _chat(conversation: list[dict], add_generation_prompt: bool, kwargs: dict, max_model_len: int) -> list[int]:
    from minivllm.frontend.inputs import render_chat

    prompt = render_chat(_tokenizer, conversation, add_generation_prompt, **kwargs)
    return _fits(_tokenizer.encode(prompt, add_special_tokens=False), max_model_len)  # the template wrote them


def _decode(ids: list[int]) -> str:
    return _tokenizer.decode(ids)


class TokenizerPool:
    def __init__(self, model: str, max_model_len: int, workers: int = 2, tokenizer: str | None = None) -> None:
        """Workers with the tokenizer of checkpoint `model` (or of the directory `tokenizer`)."""
        self.max_model_len, self.workers = max_model_len, workers
        ctx = mp.get_context("spawn")
        self.pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_load, initargs=(model, tokenizer or model, os.getpid())
        )

    async def warm_up(self) -> None:
        """Start every worker now (each loads the tokenizer), not at the first requests."""
        await asyncio.gather(*[self.decode([]) for _ in range(self.workers)])

    async def _run(self, fn, *args):
        return await asyncio.wrap_future(self.pool.submit(fn, *args))

    async def encode(self, text: str, add_special_tokens: bool = True, limit: bool = True) -> list[int]:
        """The text's ids; with `limit`, a ValueError when they leave no room for output."""
        return await self._run(_encode, text, self.limit(limit), add_special_tokens)

    async def chat(self, conversation: list[dict], add_generation_prompt: bool, limit: bool = True, **kwargs):
        """The conversation through the chat template, as ids (`limit` as for encode)."""
        return await self._run(_chat, conversation, add_generation_prompt, kwargs, self.limit(limit))

    def limit(self, limit: bool) -> int:
        return self.max_model_len if limit else 1 << 62

    async def decode(self, ids: list[int]) -> str:
        return await self._run(_decode, ids)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
