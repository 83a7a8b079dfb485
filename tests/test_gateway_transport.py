"""The gateway client's one attempt over httpcore (`engine.gateway.transport`): what it
returns when nothing answers, and the answer's headers as the retry decisions read them."""

from __future__ import annotations

import socket

import httpcore

from runplane.engine.gateway import protocol
from runplane.engine.gateway.transport import HTTP_ERRORS, _attempt, response_headers


def test_answer_headers_are_read_by_lower_case_name():
    headers = response_headers([(b"Retry-After", b"2.5"), (b"Content-Type", b"application/json")])
    assert headers == {"retry-after": "2.5", "content-type": "application/json"}
    assert protocol.retry_after_s({}, headers, None) == 2.5


async def test_a_port_nobody_listens_on_is_an_unanswered_attempt():
    with socket.socket() as probe:  # a free loopback port, closed again: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with httpcore.AsyncConnectionPool() as pool:
        got = await _attempt(pool, "GET", f"http://127.0.0.1:{port}/health", 5.0, None, {})
    assert got.status is None and got.payload is None
    assert isinstance(got.failure, HTTP_ERRORS)
