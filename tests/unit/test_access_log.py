"""The access log's redaction of credentials in query strings, and how a dead engine's end is
told (issue 32 point 6)."""

from __future__ import annotations

import logging

import pytest

from axon.engine.exit_status import describe_exit
from axon.server.access_log import RedactQuerySecrets, redact_query


@pytest.mark.parametrize(
    ("target", "logged"),
    [
        ("/v1/models?api_key=sk-1", "/v1/models?api_key=REDACTED"),
        ("/x?limit=2&Token=t&key=k&a=1", "/x?limit=2&Token=REDACTED&key=REDACTED&a=1"),
        ("/x?hf_token=t&client_secret=s", "/x?hf_token=REDACTED&client_secret=REDACTED"),
        ("/x?X-Api-Key=k", "/x?X-Api-Key=REDACTED"),
        ("/x?api%5Fkey=k", "/x?api%5Fkey=REDACTED"),
        ("/health", "/health"),
        ("/x?flag&keys_seen=3", "/x?flag&keys_seen=3"),
    ],
)  # fmt: skip
def test_query_secrets_are_redacted(target, logged):
    assert redact_query(target) == logged


def test_the_filter_rewrites_uvicorns_access_record():
    args = ("127.0.0.1:5000", "GET", "/v1/models?api_key=sk-1", "1.1", 200)
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None
    )
    assert RedactQuerySecrets().filter(record)
    assert record.getMessage() == '127.0.0.1:5000 - "GET /v1/models?api_key=REDACTED HTTP/1.1" 200'


def test_an_engine_exit_is_told_by_signal_or_code():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-15) == "killed by SIGTERM"
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(None) == "exited (exit status unknown)"
