"""A tokenizer worker process of the server's pool (tokenizer_pool.py): it loads the checkpoint's tokenizer once,
then answers jobs from its pipe one at a time: encode a prompt, render a conversation through the chat template,
decode ids. A prompt longer than the model can take is refused here, so its ids never travel back; a request's own
error (a template that fails, an id beyond 32 bits) goes back as a ValueError or TypeError (a 400), anything else as
a RuntimeError (a 500). It leaves when told to, when its pipe closes, or when its parent is gone."""

import os
import threading
import time

from minivllm.engine.tp_workers import set_process_name

TOKENIZER = "minivllm-tok"  # a tokenizer worker's name in ps / top (bench_serve.py counts it as the API server's)
_tokenizer = None  # the worker process's own


def _load(model: str, tokenizer: str, parent: int) -> None:
    global _tokenizer
    from transformers import AutoConfig

    from minivllm.checkpoint import load_tokenizer

    set_process_name(TOKENIZER)
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    _tokenizer = load_tokenizer(tokenizer, AutoConfig.from_pretrained(model))


def _exit_with(parent: int) -> None:
    """A worker blocked on its pipe does not notice a killed server: it leaves once its parent is gone."""
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
    from jinja2 import TemplateError

    from minivllm.frontend.inputs import render_chat

    try:
        prompt = render_chat(_tokenizer, conversation, add_generation_prompt, **kwargs)
    except TemplateError as e:  # a template that does not parse, fails or breaks the sandbox: the request's fault
        raise ValueError(f"chat template error: {type(e).__name__}: {e}") from None
    return _fits(_tokenizer.encode(prompt, add_special_tokens=False), max_model_len)  # the template wrote them


def _decode(ids: list[int]) -> str:
    return _tokenizer.decode(ids)


JOBS = dict(encode=_encode, chat=_chat, decode=_decode)


def serve_jobs(conn, model: str, tokenizer: str, parent: int) -> None:
    """A worker process: load the tokenizer, say so, then answer jobs one at a time until told to stop."""
    try:
        _load(model, tokenizer, parent)
    except Exception as e:  # (no tokenizer there, a broken file): the server logs why
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the server is gone
            return
        except RecursionError as e:  # a job nested too deeply to unpickle: the request's fault
            conn.send(("error", ValueError(f"the request cannot be tokenised: {e}")))
            continue
        if job is None:
            return
        name, args = job
        try:
            conn.send(("ok", JOBS[name](*args)))
        except RecursionError as e:  # a field nested deeper than this process recurses (its parent may allow more)
            conn.send(("error", ValueError(f"the request cannot be tokenised: {e}")))
        except (ValueError, TypeError, OverflowError) as e:  # the request's fault (an id beyond 32 bits...): a 400
            conn.send(("error", (TypeError if isinstance(e, TypeError) else ValueError)(str(e))))
        except Exception as e:  # anything else, as an error that pickles: a 500
            conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))
