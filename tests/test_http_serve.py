"""The gateway's Hypercorn worker (`engine.gateway.http_serve`): one keep-alive timer task per
connection instead of one per request, and a request's body handed to the application without
a turn of the event loop when it has arrived, with Hypercorn's behaviour kept: an idle
connection closes after `keep_alive_timeout`, never during a request; a shutdown closes idle
connections and lets a request in flight finish; a body that arrives slowly, or faster than
the application reads it, reaches it whole; a response's head goes out with its body in one
write when it declares a length. No database here: a small ASGI app."""

from __future__ import annotations

import collections
import hashlib

import h11
import trio
from hypercorn.config import Config

from runplane.engine.gateway.http_serve import serve

KEEP_ALIVE_S = 0.3
SLOW_S = KEEP_ALIVE_S * 3
PAUSE_S = 0.2


class Steps(trio.abc.Instrument):
    """How many times each task was run (a task that yields is run again)."""

    def __init__(self) -> None:
        self.of: dict[trio.lowlevel.Task, int] = collections.Counter()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.of[task] += 1


async def app(scope, receive, send) -> None:
    assert scope["type"] == "http"
    if scope["path"] == "/late-reader":
        await trio.sleep(0.2)  # the body's pieces fill the application's queue meanwhile
    received, yields = b"", 0
    steps = Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        while True:
            before = steps.of[trio.lowlevel.current_task()]
            message = await receive()
            yields += steps.of[trio.lowlevel.current_task()] > before
            received += message.get("body", b"")
            if not message.get("more_body"):
                break
    finally:
        trio.lowlevel.remove_instrument(steps)
    if scope["path"] == "/slow":
        await trio.sleep(SLOW_S)
    body = scope["path"].encode()
    if scope["method"] == "POST":
        body = f"{len(received)} {hashlib.sha256(received).hexdigest()} {yields}".encode()
    if scope["path"] == "/stream":  # no length: a stream, its head due at once
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await trio.sleep(PAUSE_S)
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    if scope["path"] == "/paused":
        await trio.sleep(PAUSE_S)  # between the head and the body
    await send({"type": "http.response.body", "body": body})


class Client:
    """One kept-alive HTTP/1.1 connection, parsed with h11."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream, self.h11 = stream, h11.Connection(h11.CLIENT)

    async def get(self, path: str, method: str = "GET") -> bytes:
        await self.ask(path, method)
        return await self.answer()

    async def ask(self, path: str, method: str = "GET") -> None:
        await self.stream.send_all(self.h11.send(h11.Request(
            method=method, target=path, headers=[("host", "test")])) + self.h11.send(
            h11.EndOfMessage()))

    async def answer(self) -> bytes:
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

    async def post(self, path: str, pieces: list[bytes], pause_s: float) -> bytes:
        """POST the body `pieces`, each its own write (`pause_s` between them); the answer."""
        head = self.h11.send(h11.Request(method="POST", target=path, headers=[
            ("host", "test"), ("content-length", str(sum(map(len, pieces))))]))
        await self.stream.send_all(head)
        for piece in pieces:
            await self.stream.send_all(self.h11.send(h11.Data(data=piece)))
            await trio.sleep(pause_s)
        await self.stream.send_all(self.h11.send(h11.EndOfMessage()))
        return await self.answer()

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


def echoed(answer: bytes) -> tuple[bytes, int]:
    """What the application said of a POST's body (its size and digest), and how many of its
    receives yielded."""
    received, yields = answer.rsplit(b" ", 1)
    return received, int(yields)


def sent(pieces: list[bytes]) -> bytes:
    whole = b"".join(pieces)
    return f"{len(whole)} {hashlib.sha256(whole).hexdigest()}".encode()


async def test_a_body_that_has_arrived_reaches_the_application_without_a_turn():
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        client = await connect(await started(nursery, shutdown))
        body = b"x" * 1000
        for _ in range(20):  # the head and the body in one write: both taken at once
            await client.stream.send_all(client.h11.send(h11.Request(
                method="POST", target="/echo",
                headers=[("host", "test"), ("content-length", str(len(body)))]))
                + client.h11.send(h11.Data(data=body)) + client.h11.send(h11.EndOfMessage()))
            assert echoed(await client.answer()) == (sent([body]), 0)
        shutdown.set()


async def test_a_body_that_arrives_slowly_or_faster_than_it_is_read_reaches_it_whole():
    shutdown = trio.Event()
    pieces = [bytes([65 + i]) * 700 for i in range(25)]
    async with trio.open_nursery() as nursery:
        client = await connect(await started(nursery, shutdown))
        # pieces apart in time: the application waits for each (its receives yield)
        received, yields = echoed(await client.post("/echo", pieces[:5], pause_s=0.02))
        assert received == sent(pieces[:5]) and yields >= 4
        # more pieces than the application's queue holds (10) before it reads any: the
        # connection waits for room, and every byte arrives in order
        received, _ = echoed(await client.post("/late-reader", pieces, pause_s=0.001))
        assert received == sent(pieces)
        shutdown.set()


async def test_a_head_with_a_length_goes_out_with_its_body_and_a_stream_head_at_once():
    """A response that declares its length reaches the client as one write, head and body,
    even when the application pauses between them; a stream's head (no length) is written at
    once, before its body; a HEAD request's head (its body suppressed) is not held back."""
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        bind = await started(nursery, shutdown)
        client = await connect(bind)
        await client.ask("/paused")
        first = await client.stream.receive_some(65536)  # whatever the first write carried
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"\r\n\r\n/paused"), first
        client.h11.receive_data(first)
        assert await client.answer() == b"/paused"
        await client.ask("/stream")
        first = await client.stream.receive_some(65536)
        assert first.startswith(b"HTTP/1.1 200") and b"/stream" not in first, first
        client.h11.receive_data(first)
        assert await client.answer() == b"/stream"
        with trio.fail_after(5):
            assert await client.get("/headed", method="HEAD") == b""
            assert await client.get("/after") == b"/after"  # the connection goes on
        shutdown.set()
