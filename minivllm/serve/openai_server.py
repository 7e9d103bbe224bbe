"""An OpenAI-compatible HTTP server over the async engine (vLLM's `vllm serve`; FastAPI + uvicorn):
GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, the last two also streaming
(`"stream": true`: server-sent events, one `data: {chunk}` per step with new tokens, then `data: [DONE]`), and
vLLM's POST /reset_prefix_cache (for benchmarks; only with VLLM_SERVER_DEV_MODE=1), GET /metrics (Prometheus,
metrics.py), POST /tokenize, POST /detokenize, GET /version. `run_server` (what `minivllm serve` runs) puts the
engine core in a process of its own (core_client.py); tokenising, chat templates and detokenising prompts run in
a pool of processes (tokenizer_pool.py): the event loop does HTTP, JSON and SSE only, so /health answers at once
while a 5 MB prompt is tokenised.

Each HTTP request becomes one engine request per prompt (their `n` sequences are the choices); their
outputs are merged into one response. Bad input is a 400 with OpenAI's error body {"error": {"message",
"type", "param", "code"}}, and nothing is queued. A client that disconnects cancels its handler, which
closes its streams, which aborts its requests (async_llm.py): their blocks are freed at the next step.
SIGINT / SIGTERM abort every request first (streams end with finish_reason "abort"), then uvicorn closes
the connections and the engine stops with its TP workers (`run_server`); a dead engine core stops the server too
(launcher.py). Every error, FastAPI's own included, is in OpenAI's shape (http_errors.py); API keys, CORS, request
chat templates and the development endpoints are the operator's options (server_options.py). With
`--api-server-count N` each of N processes runs this app on one shared socket (api_servers.py)."""

import asyncio
import signal
import threading
import time
import uuid
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from minivllm.engine.tp_workers import free_port
from minivllm.frontend.sampling_checks import MAX_N, check_sampling_params
from minivllm.serve.async_llm import AsyncLLM, EngineDeadError
from minivllm.serve.gc_heap import startup_heap_frozen
from minivllm.serve.http_errors import add_error_handlers, error_response
from minivllm.serve.launcher import Server
from minivllm.serve.metrics import ServerMetrics
from minivllm.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from minivllm.serve.responses import ChatCompletions, Completions
from minivllm.serve.server_options import ServerOptions, add_middleware, request_chat_template
from minivllm.serve.serving_utils import BadRequest, bad_request, until_disconnect
from minivllm.serve.sse import App, SSEResponse
from minivllm.serve.tokenizer_pool import TokenizerPool, WorkerDiedError
from minivllm.serve.tokens import add_token_routes

# How long an idle keep-alive connection stays open (uvicorn's and vLLM's default: 5 s). Longer here: an engine
# in this process (AsyncLLM without its own core process) shares the GIL, and a kernel compiling inside it can hold
# the GIL for seconds; after such a stall the event loop may run an expired keep-alive timer before reading the
# client's next request, already in the socket, and lose it silently (`scripts/serve_stall.py`: a 7 s stall lost
# 40 of 160 requests with 5 s, none with 60 s; benchmarks/RESULTS.md).
TIMEOUT_KEEP_ALIVE = 60.0


def build_app(
    llm: AsyncLLM, served_model_name: str, owns_engine: bool = False, options: ServerOptions | None = None
) -> FastAPI:
    """The FastAPI app serving `llm` as `served_model_name`; with `owns_engine`, its shutdown stops the engine.
    `options`: keys, CORS, trust and dev mode (server_options.py; None: vLLM's defaults and environment)."""
    options = options if options is not None else ServerOptions.from_env()
    max_model_len = llm.max_model_len
    tokens = TokenizerPool(llm.model, max_model_len, tokenizer=llm.tokenizer_dir)
    metrics = ServerMetrics(llm, served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await tokens.warm_up()  # its processes start (import transformers, load the tokenizer) before serving
        yield
        await asyncio.to_thread(tokens.shutdown)
        if owns_engine:
            await asyncio.to_thread(llm.shutdown)

    app = App(title="minivllm", lifespan=lifespan)
    app.state.tokens = tokens  # (its workers: what /health reports on)
    add_error_handlers(app)
    add_middleware(app, options)
    add_token_routes(app, tokens, served_model_name, options.trust_request_chat_template)

    def generate(prompt_ids: list[int], sp, rid: str, streaming: bool):
        """The request's stream and its meter (metrics.py), which the response feeds each output."""
        return llm.generate({"prompt_token_ids": prompt_ids}, sp, rid), metrics.request(streaming)

    def check(body: SamplingFields) -> None:
        if body.model is not None and body.model != served_model_name:
            raise BadRequest(
                f"The model `{body.model}` does not exist (this server serves `{served_model_name}`)", "model", 404
            )
        if body.stream_options is not None and not body.stream:  # vLLM's rule
            raise BadRequest("stream_options can only be set when stream is true", "stream_options")

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_running:
            return error_response("the engine stopped", status=503)
        if not tokens.healthy:
            return error_response("the tokenizer workers cannot be restarted", status=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    if options.dev_mode:  # vLLM's development endpoint (benchmarks start each run with a cold cache)

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> dict:
            return dict(reset=await llm.reset_prefix_cache())

    @app.get("/v1/models")
    async def models() -> dict:
        card = dict(id=served_model_name, object="model", created=int(time.time()), owned_by="minivllm")
        card.update(root=llm.model, max_model_len=max_model_len)
        return dict(object="list", data=[card])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        try:
            check(body)
            if body.suffix:
                raise BadRequest("suffix is not supported", "suffix")
            if body.best_of is not None and body.best_of != body.n:
                raise BadRequest("best_of must equal n (beam search is not supported)", "best_of")
            one = isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int))  # (validated)
            prompts = [body.prompt] if one else body.prompt
            if not prompts:
                raise BadRequest("prompt must not be empty", "prompt")
            sp = body.sampling_params(body.max_tokens, body.logprobs)
            check_sampling_params(sp)  # each field's own bound first (n included), then the request's
            if len(prompts) * sp.n > MAX_N:  # n's bound holds for the sequences of the whole request
                raise BadRequest(f"{len(prompts)} prompts x n {sp.n} sequences exceed {MAX_N} in one request", "prompt")
            rid = f"cmpl-{uuid.uuid4().hex}"
            ids = [await tokens.encode(p) if isinstance(p, str) else p for p in prompts]  # off the event loop
            streams = [generate(p, sp, f"{rid}-{i}", bool(body.stream)) for i, p in enumerate(ids)]
        except (ValueError, TypeError) as e:
            return bad_request(e)
        except (EngineDeadError, WorkerDiedError) as e:
            return error_response(str(e), status=500)
        echo = [p if isinstance(p, str) else await tokens.decode(p) for p in prompts] if body.echo else None
        run = Completions(body, rid, served_model_name, streams, echo, tokenizer=llm.tokenizer)
        if body.stream:
            return SSEResponse(run.stream())
        return await until_disconnect(raw, run.full())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        try:
            check(body)
            if body.tools:
                raise BadRequest("tools are not supported", "tools")
            if body.top_logprobs is not None and not body.logprobs:
                raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
            trusted = options.trust_request_chat_template
            if refused := request_chat_template(body.chat_template, body.chat_template_kwargs, trusted):
                raise BadRequest(refused, "chat_template")
            kwargs = dict(body.chat_template_kwargs or {})
            if body.chat_template is not None:
                kwargs["chat_template"] = body.chat_template
            if body.continue_final_message:
                kwargs["continue_final_message"] = True
            try:  # the template and the tokenizer off the event loop
                ids = await tokens.chat(body.conversation(), body.add_generation_prompt, **kwargs)
            except ValueError as e:
                raise BadRequest(str(e), "messages") from None
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            sp = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            streams = [generate(ids, sp, rid, bool(body.stream))]
        except (ValueError, TypeError) as e:
            return bad_request(e, "messages")
        except (EngineDeadError, WorkerDiedError) as e:
            return error_response(str(e), status=500)
        run = ChatCompletions(body, rid, served_model_name, streams, None)
        if body.stream:
            return SSEResponse(run.stream())
        return await until_disconnect(raw, run.full())

    return app


def run_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "info",
    timeout_keep_alive: float = TIMEOUT_KEEP_ALIVE,
    options: ServerOptions | None = None,
    llm: AsyncLLM | None = None,
    sockets: list | None = None,
    parent_pid: int | None = None,
    stream_interval: int = 1,
    **engine_args,
) -> None:
    """Serve until SIGINT / SIGTERM; then the requests are aborted, the connections closed, the engine core
    process and its TP workers stopped, and this returns (uvicorn re-raises the signal it caught: it finds a
    no-op here). If the engine core dies, the server stops and this raises EngineDeadError (launcher.py).
    One of several API servers (api_servers.py) brings its client of the shared core (`llm`), the listening
    socket (`sockets`) and its parent's pid (it stops when the parent is gone). `stream_interval`: vLLM's
    `--stream-interval` (a stream's tokens per event after its first; the client brought has its own)."""
    llm = llm if llm is not None else AsyncLLM(model, multiprocess=True, stream_interval=stream_interval, **engine_args)
    app = build_app(llm, served_model_name or model, owns_engine=True, options=options)
    keep_alive = dict(timeout_keep_alive=timeout_keep_alive, timeout_graceful_shutdown=10)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, **keep_alive)
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    server = Server(config, llm, parent_pid)
    try:
        with startup_heap_frozen():  # (a full collection would pause every stream ~0.1 s: gc_heap.py)
            server.run(sockets=sockets)
    finally:
        llm.shutdown()  # (done already by the app's shutdown, unless uvicorn failed to start)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if server.engine_died:
        raise EngineDeadError(f"the engine core died ({llm.error}): the server stopped, for its supervisor to restart")


class ServerThread:
    """The server in a background thread of this process, for tests and notebooks:
    `with ServerThread(llm, "name") as server: server.url`. The engine stays the caller's."""

    def __init__(
        self,
        llm: AsyncLLM,
        served_model_name: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        options: ServerOptions | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.app = build_app(llm, served_model_name, options=options)
        config = uvicorn.Config(
            self.app, host=host, port=self.port, log_level="warning", timeout_keep_alive=TIMEOUT_KEEP_ALIVE
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="minivllm-server", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
