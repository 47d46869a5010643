"""What the server refuses, and how: every refusal is an ApiError (status + one-line message) answered as
{"error": {"message", "type"}}. Auth and the upload size are checked in an ASGI middleware, from the headers
and while the body streams in, before any of it is parsed or stored."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout", 413: "request_too_large", 415: "unsupported_media_type", 422: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "unavailable", 504: "timeout"}

# messages of the CLI's file checks (xattn/tasks/vision.py, audio.py) that say the bytes are not a format we read
UNREADABLE = ("not a readable image", "not a readable audio file")


class ApiError(HTTPException):
    """A refusal: HTTP status, one line for the client, optional headers (Retry-After, WWW-Authenticate). An
    HTTPException, so FastAPI passes it through its body parsing unchanged (a body cut at the size limit)."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(status, message, headers)
        self.message = message


def error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error")}}


def file_error(message: str) -> ApiError:
    """A bad upload: 415 when its bytes are not an image/audio format we read, else 422 (read but refused: too
    long, no samples, a decompression bomb, which Pillow may refuse before xattn's own check)."""
    unreadable = any(m in message for m in UNREADABLE) and "decompression bomb" not in message.lower()
    return ApiError(415 if unreadable else 422, message)


def deadline_left(request, timeout_s: float) -> float:
    """Seconds left of the request's deadline, counted from its first byte (set by LimitsMiddleware)."""
    started = request.scope.get("state", {}).get("xattn_started", time.monotonic())
    return started + timeout_s - time.monotonic()


class LimitsMiddleware:
    """Pure ASGI: bearer-token auth on /v1/ (401 before the body is read), a request body of at most
    max_body bytes (413 from Content-Length at once, or when a streamed body passes it) that arrives whole within
    the request's deadline (408: a client sending slowly holds nothing past it), and the request's start time for
    its deadline."""

    def __init__(self, app, max_body: int, api_key: str | None, timeout_s: float = 60.0):
        self.app, self.max_body, self.api_key, self.timeout_s = app, max_body, api_key, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["xattn_started"] = time.monotonic()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key and scope["path"].startswith("/v1/") and not self._authorized(headers):
            return await _answer(send, 401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                 {"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body:
            return await _answer(send, 413, self._too_large(int(length)), {"Connection": "close"})
        seen, whole = 0, False
        deadline = scope["state"]["xattn_started"] + self.timeout_s

        async def counted_receive():
            nonlocal seen, whole
            if whole:  # the body is in: what follows is the disconnect, awaited as long as the request lives
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {self.timeout_s:g} s (--timeout-s)",
                               {"Connection": "close"}) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise ApiError(413, self._too_large(), {"Connection": "close"})
                whole = not message.get("more_body", False)
            return message

        await self.app(scope, counted_receive, send)

    def _authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())

    def _too_large(self, length: int | None = None) -> str:
        size = f"{length / 2**20:.1f} MB" if length is not None else f"over {self.max_body / 2**20:g} MB"
        return f"the request body is {size}; this server takes at most {self.max_body / 2**20:g} MB (--max-upload-mb)"


async def _answer(send, status: int, message: str, headers: dict) -> None:
    body = json.dumps(error_body(status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def add_error_handlers(app: FastAPI) -> None:
    from ..jobs import one_line

    @app.exception_handler(HTTPException)
    async def refused(request: Request, error: HTTPException) -> JSONResponse:
        message = getattr(error, "message", None) or str(error.detail)
        return JSONResponse(error_body(error.status_code, message), error.status_code, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "form"))
        message = f"{where}: {first['msg']}" if where else first["msg"]
        if where == "file" and first.get("type") in ("value_error", "missing"):  # a part without a filename is text
            said = "Field required" if first["type"] == "missing" else "not a file part"
            message = f"file: {said}; send the upload as the multipart field 'file', a file part with a filename"
        elif not where and first.get("type") in ("model_attributes_type", "dict_type", "json_invalid"):
            message = f"the body: {first['msg']}; send a JSON object (Content-Type: application/json)"
        return JSONResponse(error_body(422, message), 422)

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:  # logged by uvicorn; the server goes on
        return JSONResponse(error_body(500, f"internal error: {one_line(error)}"), 500)
