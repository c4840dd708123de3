"""API keys: `Authorization: Bearer KEY` (or HTTP basic auth, A1111's way) on the API and job routes, compared in
constant time.

Keys come from `--api-key` (repeatable), `--api-key-file` (one a line, `#` comments) and the
environment variable ONNXDIFFUSION_API_KEYS (comma or whitespace separated), as vLLM's and
llama.cpp's servers take them for their OpenAI APIs. Without keys the server is open (it binds
127.0.0.1 by default). A refused request gets 401 in OpenAI's error shape and `WWW-Authenticate:
Bearer`; nothing about the key it sent is echoed beyond OpenAI's masked form.

A caller is known by its key's index (`key-1`, ...), never by the key, in jobs and logs; jobs are
visible only to the key that made them.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from ..errors import UserError

ENV = "ONNXDIFFUSION_API_KEYS"
OPEN_PATHS = ("/", "/health", "/ready", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc")
MAX_KEY = 512


def read_keys(keys: tuple[str, ...] | list[str] = (), key_file: str | Path | None = None,
              environ: dict | None = None) -> tuple[str, ...]:
    """Every configured key, in order, duplicates dropped; bad keys are a UserError (one line)."""
    out: list[str] = list(keys or ())
    if key_file is not None:
        path = Path(key_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--api-key-file {path}: cannot read it ({type(e).__name__})") from None
        out += [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
        if not out:
            raise UserError(f"--api-key-file {path} holds no key")
    env = (os.environ if environ is None else environ).get(ENV, "")
    out += [k for k in env.replace(",", " ").split() if k]
    seen: list[str] = []
    for k in out:
        if not 8 <= len(k) <= MAX_KEY or not k.isascii() or not k.isprintable() or " " in k:
            raise UserError(f"API keys must be 8..{MAX_KEY} printable ASCII characters without spaces "
                            f"(got one of length {len(k)})")
        if k not in seen:
            seen.append(k)
    return tuple(seen)


def masked(key: str) -> str:
    """OpenAI's form in its 401 message: the first and last few characters only."""
    return f"{key[:3]}***{key[-2:]}" if len(key) > 8 else "***"


class KeyRing:
    def __init__(self, keys: tuple[str, ...]):
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def caller(self, presented: str) -> str | None:
        """`key-N` for a configured key, else None. Every key is compared (no early exit), each in constant time."""
        got = presented.encode("utf-8", "surrogateescape")
        found = None
        for i, key in enumerate(self._keys, 1):
            if hmac.compare_digest(got, key) and found is None:
                found = f"key-{i}"
        return found


def basic_caller(ring: KeyRing, token: str) -> tuple[str, str | None]:
    """HTTP basic auth: the password is a key (any user name), or `USER:PASS` as a whole is one (A1111's --api-auth
    form). Returns (what to show masked in a refusal, the caller or None)."""
    import base64
    import binascii

    try:
        user, _, password = base64.b64decode(token, validate=True).decode("utf-8").partition(":")
    except (binascii.Error, ValueError):
        return token, None
    found = [ring.caller(password), ring.caller(f"{user}:{password}")]  # both compared: no early exit
    return password, found[0] or found[1]


def _unauthorized(message: str, code: str):
    from .responses import error_response

    resp = error_response(401, message, code=code, headers={"WWW-Authenticate": "Bearer"})
    return resp


class ApiKeyAuth:
    """ASGI middleware: every route but the open ones needs a configured key; `/metrics` only when asked."""

    def __init__(self, app, ring: KeyRing, protect_metrics: bool = True):
        self.app, self.ring, self.protect_metrics = app, ring, protect_metrics

    def needs_key(self, path: str) -> bool:
        if path == "/metrics":
            return self.protect_metrics
        return path not in OPEN_PATHS

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.ring.enabled or not self.needs_key(scope.get("path", "")):
            return await self.app(scope, receive, send)
        header = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        if not header:
            resp = _unauthorized("You didn't provide an API key. You need to provide your API key in an Authorization "
                                 "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).", "missing_api_key")
            return await resp(scope, receive, send)
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() not in ("bearer", "basic") or not token.strip():
            resp = _unauthorized("The Authorization header must use Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                                 "invalid_authorization_scheme")
            return await resp(scope, receive, send)
        token = token.strip()
        if scheme.lower() == "basic":  # A1111's --api-auth USER:PASS, as its clients send it
            token, caller = basic_caller(self.ring, token)
        else:
            caller = self.ring.caller(token)
        if caller is None:
            resp = _unauthorized(f"Incorrect API key provided: {masked(token)}.", "invalid_api_key")
            return await resp(scope, receive, send)
        scope.setdefault("state", {})["caller"] = caller
        return await self.app(scope, receive, send)
