"""What the operator decides about who may call the server and what a request may bring (vLLM's flags of the same
names): `--api-key` (a bearer token every /v1 request must carry; also from the environment's VLLM_API_KEY), CORS
(`--allowed-origins`, `--allowed-methods`, `--allowed-headers`, `--allow-credentials`: Starlette's CORSMiddleware,
by default any origin as vLLM), `--trust-request-chat-template` (else a request that brings its own chat template
is refused: a template is code the tokenizer workers run), and the development endpoints (/reset_prefix_cache) only
with VLLM_SERVER_DEV_MODE=1, as vLLM."""

import hashlib
import os
import secrets
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware

from minivllm.serve.http_errors import error_body


@dataclass(slots=True)
class ServerOptions:
    api_keys: list[str] = field(default_factory=list)  # empty: no key needed
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    trust_request_chat_template: bool = False
    dev_mode: bool = False  # /reset_prefix_cache

    @classmethod
    def from_env(cls, **kwargs) -> "ServerOptions":
        """Options with vLLM's environment defaults: VLLM_API_KEY when no key is given, VLLM_SERVER_DEV_MODE=1."""
        options = cls(**kwargs)
        if not options.api_keys and os.environ.get("VLLM_API_KEY"):
            options.api_keys = [os.environ["VLLM_API_KEY"]]
        if "dev_mode" not in kwargs:
            options.dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "0") == "1"
        return options


class BearerAuth:
    """ASGI middleware: an HTTP request to /v1/... without `Authorization: Bearer <one of the keys>` gets a 401 in
    OpenAI's shape (vLLM's AuthenticationMiddleware; CORS preflights and the other paths pass). The keys are compared
    as SHA-256 digests in constant time, so the time of a refusal says nothing about a key."""

    def __init__(self, app, api_keys: list[str]) -> None:
        self.app = app
        self.digests = [hashlib.sha256(k.encode()).digest() for k in api_keys]

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        value = dict(headers).get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        digest = hashlib.sha256(token.strip()).digest()
        ok = [secrets.compare_digest(digest, d) for d in self.digests]  # every key, whatever matches
        return scheme.lower() == b"bearer" and any(ok)

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        guarded = scope["type"] == "http" and scope.get("method") != "OPTIONS" and path.startswith("/v1")
        if not guarded or self.allowed(scope["headers"]):
            return await self.app(scope, receive, send)
        body = error_body("Unauthorized: a valid API key is needed (Authorization: Bearer <key>)", None, 401)
        await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


def add_middleware(app: FastAPI, options: ServerOptions) -> None:
    """CORS, then the API key around it (vLLM's order: a refused request is refused before anything else)."""
    app.add_middleware(
        CORSMiddleware,
        allow_origins=options.allowed_origins,
        allow_credentials=options.allow_credentials,
        allow_methods=options.allowed_methods,
        allow_headers=options.allowed_headers,
    )
    if options.api_keys:
        app.add_middleware(BearerAuth, api_keys=options.api_keys)


def request_chat_template(chat_template: str | None, kwargs: dict | None, trusted: bool) -> str | None:
    """Why a chat template the request brings (the `chat_template` field or chat_template_kwargs' key) is refused,
    or None: the server trusts request templates, or there is none."""
    if trusted or (chat_template is None and (kwargs or {}).get("chat_template") is None):
        return None
    return (
        "the request brings its own chat template, but the server was not started with "
        "--trust-request-chat-template: refused"
    )
