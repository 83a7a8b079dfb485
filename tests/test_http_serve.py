"""The gateway's Hypercorn worker (`engine.gateway.http_serve`): one keep-alive deadline per
connection instead of a timer task per request, with Hypercorn's behaviour kept: an idle
connection closes after `keep_alive_timeout`, never during a request; a shutdown closes idle
connections and lets a request in flight finish. No database here: a small ASGI app."""

from __future__ import annotations

import h11
import trio
from hypercorn.config import Config

from runplane.engine.gateway.http_serve import serve

KEEP_ALIVE_S = 0.3
SLOW_S = KEEP_ALIVE_S * 3


async def app(scope, receive, send) -> None:
    assert scope["type"] == "http"
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/slow":
        await trio.sleep(SLOW_S)
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Client:
    """One kept-alive HTTP/1.1 connection, parsed with h11."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream, self.h11 = stream, h11.Connection(h11.CLIENT)

    async def get(self, path: str) -> bytes:
        await self.stream.send_all(self.h11.send(h11.Request(
            method="GET", target=path, headers=[("host", "test")])) + self.h11.send(
            h11.EndOfMessage()))
        body = b""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self.h11.start_next_cycle()
                return body

    async def closed_by_server(self) -> bool:
        with trio.move_on_after(SLOW_S * 3):
            return await self.stream.receive_some(65536) == b""
        return False


class Spawned(trio.abc.Instrument):
    def __init__(self) -> None:
        self.count = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.count += 1


async def started(nursery: trio.Nursery, shutdown: trio.Event,
                  keep_alive_s: float = KEEP_ALIVE_S) -> str:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.keep_alive_timeout = keep_alive_s
    config.graceful_timeout = 5.0
    binds = await nursery.start(lambda task_status: serve(
        app, config, shutdown_trigger=shutdown.wait, task_status=task_status))
    return binds[0].removeprefix("http://")


async def connect(bind: str) -> Client:
    host, port = bind.rsplit(":", 1)
    return Client(await trio.open_tcp_stream(host, int(port)))


async def test_a_kept_alive_connection_starts_no_task_but_its_request_s():
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        bind = await started(nursery, shutdown)
        client = await connect(bind)
        assert await client.get("/first") == b"/first"
        spawned = Spawned()
        trio.lowlevel.add_instrument(spawned)
        try:
            for i in range(50):
                assert await client.get(f"/{i}") == f"/{i}".encode()
        finally:
            trio.lowlevel.remove_instrument(spawned)
        assert spawned.count == 50  # each request's application task, and nothing else
        shutdown.set()


async def test_an_idle_connection_closes_after_the_keep_alive_never_during_a_request():
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        bind = await started(nursery, shutdown)
        busy = await connect(bind)
        for _ in range(8):  # requests more often than the keep-alive, for longer than it
            assert await busy.get("/again") == b"/again"
            await trio.sleep(KEEP_ALIVE_S / 3)
        assert await busy.get("/slow") == b"/slow"  # longer than the keep-alive, not cut
        assert await busy.closed_by_server()  # then idle past it: closed
        shutdown.set()


async def test_a_shutdown_closes_idle_connections_and_lets_a_request_finish():
    shutdown = trio.Event()
    answers = []
    async with trio.open_nursery() as nursery:
        bind = await started(nursery, shutdown, keep_alive_s=60.0)  # only the shutdown closes
        idle, working = await connect(bind), await connect(bind)
        assert await idle.get("/idle") == b"/idle"

        async def slow() -> None:
            answers.append(await working.get("/slow"))

        nursery.start_soon(slow)
        await trio.sleep(SLOW_S / 3)  # the slow request is in flight
        shutdown.set()
        assert await idle.closed_by_server()
    assert answers == [b"/slow"]


def live_tasks() -> int:
    """Every task of this trio run."""
    def count(task: trio.lowlevel.Task) -> int:
        return 1 + sum(count(child) for nursery in task.child_nurseries
                       for child in nursery.child_tasks)
    return count(trio.lowlevel.current_root_task())


async def test_a_connection_its_peer_closes_ends_at_once_not_after_the_keep_alive():
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        bind = await started(nursery, shutdown, keep_alive_s=60.0)
        await trio.sleep(0.1)  # the listener is up, and nothing else is starting
        before = live_tasks()
        client = await connect(bind)
        assert await client.get("/x") == b"/x"
        assert live_tasks() > before  # the connection's tasks
        await client.stream.aclose()
        with trio.fail_after(SLOW_S * 3):
            while live_tasks() > before:
                await trio.sleep(0.01)
        shutdown.set()
