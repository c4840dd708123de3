"""Request-body limits: every POST/PUT/PATCH body is counted while it is read, not just its declared length.

JSON routes share one small limit (`ServeConfig.max_body`); routes that take uploads (`/v1/images/edits`)
have their own larger, still bounded one (`ServeConfig.max_edit_body`).
"""

from __future__ import annotations

from .responses import error_response


class BodyLimit:
    """ASGI middleware: refuse request bodies over the path's limit with 413 in OpenAI's error shape."""

    def __init__(self, app, limit: int, per_path: dict[str, int] | None = None):
        self.app, self.limit, self.per_path = app, limit, dict(per_path or {})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.per_path.get(scope.get("path", ""), self.limit)
        declared = dict(scope["headers"]).get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > limit
        chunks, size, more = [], 0, not too_big
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            too_big = size > limit
            more = message.get("more_body", False) and not too_big
        if too_big:
            resp = error_response(413, f"request body is larger than {limit} bytes", code="body_too_large")
            return await resp(scope, receive, send)
        body = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
