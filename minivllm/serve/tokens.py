"""vLLM's utility endpoints beside the OpenAI API: POST /tokenize (a prompt, or messages through the chat
template), POST /detokenize, GET /version. The tokenizer work runs in the server's tokenizer pool, off the
event loop (tokenizer_pool.py)."""

from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import Field

from minivllm.serve.http_errors import error_response
from minivllm.serve.protocol import ChatMessage, OpenAIModel
from minivllm.serve.server_options import request_chat_template
from minivllm.serve.tokenizer_pool import TokenizerPool


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt (a chat template writes its own)
    add_generation_prompt: bool = True  # for messages
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None  # refused unless the server trusts request templates


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def package_version() -> str:
    try:
        return version("minivllm")
    except PackageNotFoundError:
        return "unknown"


def add_token_routes(app: FastAPI, tokens: TokenizerPool, served_model_name: str, trust_templates: bool) -> None:
    def unknown(model: str | None) -> JSONResponse | None:
        if model is None or model == served_model_name:
            return None
        message = f"The model `{model}` does not exist (this server serves `{served_model_name}`)"
        return error_response(message, "model", 404)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if (bad := unknown(body.model)) is not None:
            return bad
        if (body.prompt is None) == (body.messages is None):
            return error_response("give exactly one of prompt and messages", "prompt")
        try:
            if body.messages is not None:
                conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
                if refused := request_chat_template(body.chat_template, body.chat_template_kwargs, trust_templates):
                    return error_response(refused, "chat_template")
                kwargs = dict(body.chat_template_kwargs or {})
                if body.chat_template is not None:
                    kwargs["chat_template"] = body.chat_template
                ids = await tokens.chat(conversation, body.add_generation_prompt, limit=False, **kwargs)
            else:
                ids = await tokens.encode(body.prompt, body.add_special_tokens, limit=False)
        except (ValueError, TypeError) as e:
            return error_response(str(e), "messages" if body.messages is not None else "prompt")
        return dict(count=len(ids), max_model_len=tokens.max_model_len, tokens=ids, token_strs=None)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if (bad := unknown(body.model)) is not None:
            return bad
        try:
            return dict(prompt=await tokens.decode(body.tokens))
        except (ValueError, TypeError, OverflowError) as e:
            return error_response(f"tokens: {e}", "tokens")

    @app.get("/version")
    async def server_version() -> dict:
        return dict(version=package_version())
