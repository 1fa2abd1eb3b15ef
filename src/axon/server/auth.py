"""API-key checks. With `--api-key` / `AXON_API_KEY` set, a route that depends on
`require_api_key` answers 401 (OpenAI's envelope) unless `Authorization: Bearer <key>` matches.
With `--admin-api-key` / `AXON_ADMIN_API_KEY` set too (the gateway's key), the node-management
routes (`require_admin_key`: load, unload) take only that key, the inference key gets a 403 there;
the node's read-only routes (`require_node_key`) take either; inference routes never take the
admin key. `/health` and `/metrics` stay open so that probes and scrapers need no secret.

Every check is a route dependency that reads headers only: FastAPI runs it before the handler
reads the body, and the edge (edge.py) reads a body only when the route does, so an
unauthenticated upload is answered without being read. A route must therefore read its body
itself (`await request.body()`), never take it as a parameter, which FastAPI reads first."""

from __future__ import annotations

import hmac

from fastapi import Request

from axon.server.errors import Forbidden, Unauthorized

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value, or None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _same(token: str, key: str | None) -> bool:
    return key is not None and hmac.compare_digest(token.encode(), key.encode())


def check_api_key(expected: str | None, authorization: str | None) -> None:
    """Raises Unauthorized unless `expected` is None or the header carries it."""
    if expected is None:
        return
    token = bearer_token(authorization)
    if token is None:
        raise Unauthorized(
            "missing API key: send 'Authorization: Bearer <key>'", headers=_CHALLENGE
        )
    if not _same(token, expected):
        raise Unauthorized("incorrect API key provided", headers=_CHALLENGE)


def check_admin_key(config, authorization: str | None) -> None:
    """Node management: the admin key when one is set (the inference key: 403), else the API
    key as on every other route."""
    if config.admin_api_key is None:
        check_api_key(config.api_key, authorization)
        return
    token = bearer_token(authorization)
    if token is not None and _same(token, config.admin_api_key):
        return
    if token is not None and _same(token, config.api_key):
        raise Forbidden(
            "this route needs the admin API key (--admin-api-key), not the inference key"
        )
    check_api_key(config.admin_api_key, authorization)  # 401: missing or incorrect


def check_node_key(config, authorization: str | None) -> None:
    """The node's read-only routes: the inference key or the admin key (the gateway's)."""
    token = bearer_token(authorization)
    if token is not None and _same(token, config.admin_api_key):
        return
    check_api_key(config.api_key, authorization)


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: the server's key (`app.state.axon.config.api_key`) must be presented."""
    check_api_key(request.app.state.axon.config.api_key, request.headers.get("authorization"))


async def require_admin_key(request: Request) -> None:
    """FastAPI dependency of the node-management routes (check_admin_key)."""
    check_admin_key(request.app.state.axon.config, request.headers.get("authorization"))


async def require_node_key(request: Request) -> None:
    """FastAPI dependency of the node's read-only routes (check_node_key)."""
    check_node_key(request.app.state.axon.config, request.headers.get("authorization"))
