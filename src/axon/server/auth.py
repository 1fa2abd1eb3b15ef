"""API-key check: with `--api-key` / `AXON_API_KEY` set, a route that depends on
`require_api_key` answers 401 (OpenAI's envelope) unless `Authorization: Bearer <key>` matches.
`/health` and `/metrics` stay open so that probes and scrapers need no secret."""

from __future__ import annotations

import hmac

from fastapi import Request

from axon.server.errors import Unauthorized

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value, or None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def check_api_key(expected: str | None, authorization: str | None) -> None:
    """Raises Unauthorized unless `expected` is None or the header carries it."""
    if expected is None:
        return
    token = bearer_token(authorization)
    if token is None:
        raise Unauthorized(
            "missing API key: send 'Authorization: Bearer <key>'", headers=_CHALLENGE
        )
    if not hmac.compare_digest(token.encode(), expected.encode()):
        raise Unauthorized("incorrect API key provided", headers=_CHALLENGE)


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: the server's key (`app.state.axon.config.api_key`) must be presented."""
    check_api_key(request.app.state.axon.config.api_key, request.headers.get("authorization"))
