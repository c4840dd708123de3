"""Errors in OpenAI's shape, shared by the app's routes and the key middleware."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)
