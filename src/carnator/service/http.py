"""HTTP plumbing under ``carnator serve``'s routes: the JSON error every answer uses, the request body limit, and
uvicorn's protocol answering unparseable requests in that JSON too.

Every error is JSON ``{"error": {"type", "message"}}`` with a one-line message, never a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from fastapi.responses import JSONResponse


class ApiError(Exception):
    def __init__(self, status: int, type: str, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type, message, dict(headers or {})


def error_response(status: int, type: str, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": type, "message": message}}, status_code=status, headers=dict(headers or {}))


def json_http_protocol() -> type:
    """uvicorn's HTTP protocol, answering a request it cannot parse (a bad Content-Length, a broken header) with the
    service's JSON error instead of its plain-text 400; the connection then closes, as uvicorn's does."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class JsonErrorProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def send_400_response(self, msg: str) -> None:
            body = json.dumps({"error": {"type": "bad_request", "message": "the request is not valid HTTP/1.1 (a bad "
                                         "Content-Length, request line or header)"}}).encode()
            head = (f"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                    "connection: close\r\n\r\n").encode()
            self.transport.write(head + body)
            self.transport.close()

    return JsonErrorProtocol


class BodyLimit:
    """413 for a request body over ``limit`` bytes (declared or streamed); 400 for a bad Content-Length."""

    def __init__(self, app, limit: int, on_reject=None):
        self.app, self.limit, self.on_reject = app, limit, on_reject or (lambda: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await error_response(400, "bad_request", "bad Content-Length")(scope, receive, send)
            if int(declared) > self.limit:
                self.on_reject()
                return await _too_large(self.limit)(scope, receive, send)
        seen = 0
        started = False

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return msg

        async def tracking_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited, tracking_send)
        except _TooLarge:
            self.on_reject()
            if not started:
                await _too_large(self.limit)(scope, receive, send)


class _TooLarge(Exception):
    pass


def _too_large(limit: int) -> JSONResponse:
    return error_response(413, "too_large", f"the request body is over {limit} bytes")


__all__ = ["ApiError", "BodyLimit", "error_response", "json_http_protocol"]
