"""A client that goes away in the middle of its request body is counted and answered to nobody,
quietly: no traceback in the gateway's log (seen under load, issue 43)."""

from __future__ import annotations

import logging

import trio

from .gateway_support import serving, token_for


async def test_a_client_gone_mid_body_is_counted_without_a_traceback(tenant, caplog):
    caplog.set_level(logging.DEBUG, logger="runplane")
    async with serving(tenant) as server:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        head = (f"POST /v1/actions/runs.list_runs HTTP/1.1\r\nhost: {host}\r\n"
                f"authorization: Bearer {token_for(tenant)}\r\n"
                "content-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"scope\":")
        await stream.send_all(head.encode())
        await stream.aclose()  # gone before the other 991 bytes
        with trio.fail_after(10):
            while server.errors["client_disconnected"] == 0:
                await trio.sleep(0.01)
    assert "failed unexpectedly" not in caplog.text
    assert "Traceback" not in caplog.text
