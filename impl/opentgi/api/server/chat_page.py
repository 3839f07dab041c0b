"""The chat page at `GET /` (TGI's `POST /` is untouched): one static file, `chat.html`, that streams
from this server's `/v1/chat/completions`.

It is served by an ASGI middleware in front of Connexion's routing, so it is no operation of any
OpenAPI document (TGI's document has `POST /` only). Only a request that asks for HTML (a browser's
`Accept: text/html`) gets the page; any other `GET /` is TGI's 405, as API clients and schemathesis'
undeclared-method check expect. The page holds nothing secret and is served without the API key;
the requests it makes send the key. `--disable-ui` turns it off.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

# The page loads nothing from elsewhere; the policy makes the browser hold it to that.
HEADERS = [
    (b"content-type", b"text/html; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'"),
    (b"x-content-type-options", b"nosniff"),
]


@cache
def page() -> bytes:
    return resources.files("opentgi.api.server").joinpath("chat.html").read_bytes()


def _wants_html(scope) -> bool:
    return any(name == b"accept" and b"text/html" in value.lower() for name, value in scope.get("headers", ()))


class ChatPageMiddleware:
    """ASGI middleware: `GET /` and `HEAD /` answer the chat page; everything else passes on."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["path"] != "/" or scope["method"] not in ("GET", "HEAD")
                or not _wants_html(scope)):
            await self.app(scope, receive, send)
            return
        body = page()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*HEADERS, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
