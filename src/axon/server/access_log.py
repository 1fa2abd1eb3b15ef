"""The access log without secrets: query parameters that carry a credential are redacted.

Some clients send their key in the URL (`?api_key=…`, `?token=…`), and uvicorn's access log
writes each request's target whole; a log file readable by more people than the key should be
must not hold it. The names and the suffixes below cover the usual spellings.
"""

from __future__ import annotations

import logging
from urllib.parse import unquote_plus

ACCESS_LOGGER = "uvicorn.access"
REDACTED = "REDACTED"
SECRET_NAMES = {"api_key", "apikey", "api-key", "key", "token", "auth", "authorization", "sig"}
SECRET_SUFFIXES = ("key", "token", "secret", "password", "signature", "credential")


def is_secret(name: str) -> bool:
    """Whether a query parameter's name says it carries a credential."""
    name = unquote_plus(name).strip().lower()
    return name in SECRET_NAMES or name.endswith(SECRET_SUFFIXES)


def redact_query(target: str) -> str:
    """`target` (a path with its query string) with every secret parameter's value replaced."""
    path, mark, query = target.partition("?")
    if not mark:
        return target
    parts = []
    for part in query.split("&"):
        name, equals, _ = part.partition("=")
        parts.append(f"{name}={REDACTED}" if equals and is_secret(name) else part)
    return f"{path}?{'&'.join(parts)}"


class RedactQuerySecrets(logging.Filter):
    """Rewrites uvicorn's access record (client, method, target, http version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


def install() -> None:
    """Adds the filter to uvicorn's access logger (after uvicorn configured its logging)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, RedactQuerySecrets) for f in logger.filters):
        logger.addFilter(RedactQuerySecrets())
