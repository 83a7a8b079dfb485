"""The gateway client's one attempt (`engine.gateway.transport`) over its HTTP/1.1 connections
(`engine.gateway.http11`): what it returns when nothing answers or an answer is cut short, and
which connections it keeps alive, and the answer's headers by lower-case name."""

from __future__ import annotations

import socket

import trio

from runplane.engine.gateway import protocol
from runplane.engine.gateway.http11 import ConnectionPool, TransportError
from runplane.engine.gateway.transport import _attempt


async def test_a_port_nobody_listens_on_is_an_unanswered_attempt():
    with socket.socket() as probe:  # a free loopback port, closed again: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = ConnectionPool(f"http://127.0.0.1:{port}")
    got = await _attempt(pool, "GET", "/health", 5.0, None, {})
    assert got.status is None and got.payload is None
    assert isinstance(got.failure, TransportError)
    assert f"cannot connect to 127.0.0.1:{port}" in str(got.failure)


async def serve_raw(answers: list[bytes], accepted: list[int] | None = None,
                    close_each: bool = False, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A listener answering each request it reads with the next of `answers` (raw bytes: the
    server side, written by the test); a connection ends after an answer saying
    `connection: close`, or after every answer with `close_each` (closed without saying so).
    Counts the connections it accepted in `accepted`."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    pending = list(answers)
    async with listeners[0]:
        while pending:
            stream = await listeners[0].accept()
            if accepted is not None:
                accepted.append(1)
            async with stream:
                while pending:
                    request = b""
                    while b"\r\n\r\n" not in request:
                        data = await stream.receive_some(65536)
                        if not data:
                            break
                        request += data
                    if not data:
                        break
                    answer = pending.pop(0)
                    await stream.send_all(answer)
                    if close_each or b"connection: close" in answer.lower():
                        break


OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 13\r\n\r\n{"result": 1}'


async def test_a_whole_answer_keeps_its_connection_and_a_cut_one_reports_its_status():
    cut = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\ncontent-length: 50\r\n" \
          b"connection: close\r\n\r\n{\"err"
    accepted: list[int] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_raw, [OK, OK, cut], accepted)
        pool = ConnectionPool(f"http://127.0.0.1:{port}")
        first = await _attempt(pool, "POST", "/v1/actions/x", 5.0, b"{}", {"x-a": "1"})
        assert (first.status, first.payload) == (200, {"result": 1})
        assert len(pool._idle) == 1  # kept alive
        second = await _attempt(pool, "POST", "/v1/actions/x", 5.0, b"{}", {})
        assert second.payload == {"result": 1} and len(pool._idle) == 1
        third = await _attempt(pool, "POST", "/v1/actions/x", 5.0, b"{}", {})
        assert third.status == 503 and third.payload is None
        assert third.headers is not None and third.headers["retry-after"] == "1"  # by lower-case name
        assert protocol.retry_after_s({}, third.headers, None) == 1
        assert isinstance(third.failure, TransportError) and pool._idle == []
        assert len(accepted) == 1  # one connection carried all three
        await pool.aclose()


async def test_an_idle_connection_the_server_closed_is_not_reused():
    accepted: list[int] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_raw, [OK, OK], accepted, True)
        pool = ConnectionPool(f"http://127.0.0.1:{port}")
        assert (await _attempt(pool, "GET", "/health", 5.0, None, {})).payload == {"result": 1}
        assert len(pool._idle) == 1
        with trio.fail_after(5):
            while not pool._idle[0].socket.is_readable():  # the server's close has arrived
                await trio.sleep(0.01)
        # reused, the closed connection would fail the attempt; a new one answers it
        second = await _attempt(pool, "GET", "/health", 5.0, None, {})
        assert second.failure is None and second.payload == {"result": 1}
        assert len(accepted) == 2
        await pool.aclose()
