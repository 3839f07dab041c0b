"""Limits on the way in, before any parsing: the body's size (`--payload-limit`, TGI's flag) and its
content type. One ASGI middleware; its refusals are errors of the path's dialect, in its shape.

A body longer than the limit is a 413 as soon as its Content-Length says so, or as soon as the bytes
read pass the limit (a chunked body): nothing more is read or parsed. A body sent without a
Content-Type is a 415, as axum's `Json` extractor answers it (Connexion let it through as a 500).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response

from opentgi.api.errors import PayloadTooLargeError, UnsupportedMediaTypeError

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class InputLimitsMiddleware:
    """Reads (and replays) the body of every request that may have one, refusing it past the limit."""

    def __init__(self, app, *, payload_limit: int, error_response: Callable[[str, Exception], Response]):
        self.app = app
        self.limit = payload_limit
        self.error_response = error_response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = {name.lower(): value for name, value in scope.get("headers", ())}
        declared = headers.get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send, PayloadTooLargeError(self.limit))
            return
        chunks: list[bytes] = []
        size = 0
        early: dict | None = None  # the client left before its body was complete
        while True:
            message = await receive()
            if message["type"] != "http.request":
                early = message
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(scope, receive, send, PayloadTooLargeError(self.limit))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if size and early is None and not headers.get(b"content-type", b"").strip():
            await self._refuse(scope, receive, send, UnsupportedMediaTypeError())
            return
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                if early is not None:
                    return early
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, exc: Exception) -> None:
        await self.error_response(scope["path"], exc)(scope, receive, send)
