"""What one client may ask of a shared server: the limits, and the ASGI guard on body size.

The engine bounds what a request may ask of a step (top_logprobs_num, stop strings, constraint builds:
EngineConfig); the server bounds what an HTTP request may ask of the server (body bytes, prompts per
request, live requests) and who may act on everyone's requests. Trust model: one API key is one tenant,
so any holder of the key may abort any request whose (unguessable) id it knows; actions on every
request at once (`abort_all`, `/flush_cache`) need the admin key.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jsgl.engine.admission import check_text
from jsgl.errors import InvalidRequestError


@dataclasses.dataclass
class ServerLimits:
    max_body_bytes: int = 16 << 20  # a request body; 50 MB of prompt once took 48 s just to tokenize
    max_batch_prompts: int = 512  # prompts (times n choices) in one HTTP request
    max_concurrent_requests: int = 2048  # engine requests live at once, over all clients (503 beyond)
    admin_key: str | None = None  # for abort_all and /flush_cache (see the module doc)

    def is_admin(self, authorization: str | None, api_key: str | None) -> bool:
        """With an admin key, only it; with no key at all (a local, single-user server), anyone; with
        only a tenant API key, nobody."""
        if self.admin_key:
            return hmac.compare_digest((authorization or "").encode(), f"Bearer {self.admin_key}".encode())
        return not api_key


def error_body(message: str, status: int, type_: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


class BodySizeLimit:
    """Answers 413 before the app reads a body over `max_bytes`: by Content-Length when given, else by
    counting the chunks as they arrive (chunked transfer encoding)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # raised inside the route's body read: the app's handler answers
                    raise HTTPException(413, detail=self.message)
            return message

        await self.app(scope, counted, send)

    @property
    def message(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes} bytes (--max-body-bytes)"

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        await JSONResponse(error_body(self.message, 413), status_code=413)(scope, receive, send)


def find_invalid_unicode(value: Any, path: str = "body") -> str | None:
    """Where a decoded JSON value holds a string that is not valid Unicode (JSON escapes allow lone
    surrogates; UTF-8, the tokenizer and our responses do not), or None."""
    try:  # one C-speed pass for the common case: the walk below builds a path per key (~50 us a body)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return None
    except (UnicodeEncodeError, TypeError, ValueError):
        return _find_invalid_unicode(value, path)


def _find_invalid_unicode(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        try:
            check_text(value, path)
        except InvalidRequestError as exc:
            return str(exc)
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = str(key).encode("utf-8", "backslashreplace").decode()  # the path goes into a response
            found = _find_invalid_unicode(key, f"{path}.{name}") or _find_invalid_unicode(item, f"{path}.{name}")
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _find_invalid_unicode(item, f"{path}[{i}]")
            if found:
                return found
    return None
