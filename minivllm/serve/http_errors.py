"""Every error the server answers in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, FastAPI's and
Starlette's own included (vLLM's server does the same): a body that is not JSON, not UTF-8 or nested too deep, a
field of the wrong type (400 naming the field: validation errors are 400, as OpenAI's and vLLM's, not FastAPI's
422), an unknown path (404) or method (405), and any exception a handler did not expect (500, logged: the server
goes on serving)."""

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from minivllm.serve.messages import EngineDeadError, RequestFailedError

logger = logging.getLogger("minivllm.serve")

ERROR_TYPES = {  # the openai client's exception class for each status
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, param: str | None = None, status: int = 400) -> dict:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    kind = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.title().replace(" ", "").replace("-", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(message: str, param: str | None = None, status: int = 400, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, param, status), status, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of a request that failed validation: the first problem, where it is, how many more."""
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}", None
    loc = [str(x) for x in first["loc"] if x != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) or "request body"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{where}: {first['msg']}{more}", param


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(*validation_message(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI's body parser answers a body it cannot decode (bad UTF-8, JSON nested past the parser's depth)
        # with "There was an error parsing the body": say what was wrong
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and exc.__cause__ is not None:
            message = f"{message}: {type(exc.__cause__).__name__}: {exc.__cause__}"[:500]
        return error_response(message, None, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(f"internal error: {type(exc).__name__}: {exc}"[:500], None, 500)


def failure(e: Exception) -> tuple[str | None, int]:
    """(param, status) of an error that ended a request's streams: 400 when the engine refused the request, 500
    when it failed it or died (EngineDeadError, RequestFailedError); anything else is logged, it is a bug."""
    if isinstance(e, ValueError):
        return None, 400
    if not isinstance(e, (EngineDeadError, RequestFailedError)):
        logger.error("a request's stream failed", exc_info=e)
    return None, 500
