"""The gateway client's HTTP/1.1 connections: `h11` over trio streams, kept alive.

How it works
- A `ConnectionPool` serves one origin (`http(s)://host:port` of the gateway URL).
  `request(method, target, headers, body, answer)` takes the newest idle connection, else opens
  one (trio's TCP stream, which sets TCP_NODELAY; TLS with the system's trust store, which
  `SSL_CERT_FILE` overrides), writes the request head and body in one send, reads the whole
  answer into `answer` and puts the connection back when both sides may go on (keep-alive),
  else closes it. How many requests run at once is the caller's to bound (the client's
  in-flight permits); the pool keeps at most `max_idle` idle connections.
- An idle connection is not reused once the server may have closed it: past `IDLE_EXPIRY_S`
  (shorter than the gateway's keep-alive of 75 s), or when its socket reads as readable while no
  answer is due (the server's close, arrived meanwhile). A request that did not complete (an
  error, a timeout, a cancellation) closes its connection: one is never reused in an unknown
  state.
- `h11` (the library under httpcore and Hypercorn) parses and frames every message; nothing
  here reads HTTP by hand. Against httpcore's pool this skips the pool's bookkeeping per
  request and sends a request in one write instead of two or three (the gateway then wakes
  once to read it): about 0.4 ms less of the client's CPU a request on this machine.
- Failures raise `TransportError`, saying what went wrong; `answer` then holds the status and
  headers if they had arrived (a body cut short), else no status (nothing answered).
"""

from __future__ import annotations

import ssl
import urllib.parse

import attrs
import h11
import trio

from .retry import describe

IDLE_EXPIRY_S = 30.0
READ_BYTES = 65_536


class TransportError(Exception):
    """A request that got no whole answer (the message says what happened)."""


@attrs.define(eq=False)
class Answer:
    """What arrived of an answer: its status and headers (by lower-case name), then its body."""

    status: int | None = None
    headers: dict[str, str] | None = None
    body: bytes = b""


@attrs.define(eq=False)
class _Connection:
    stream: trio.abc.Stream
    socket: trio.socket.SocketType
    protocol: h11.Connection
    idle_since: float = 0.0


@attrs.define(eq=False)
class ConnectionPool:
    """Keep-alive connections to the origin of `url` (module docstring)."""

    url: str
    max_idle: int = 8
    host: str = attrs.field(init=False)
    port: int = attrs.field(init=False)
    tls: bool = attrs.field(init=False)
    _host_header: bytes = attrs.field(init=False)
    _idle: list[_Connection] = attrs.field(init=False, factory=list)
    _ssl: ssl.SSLContext | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.tls else 80)
        self._host_header = parts.netloc.rsplit("@", 1)[-1].encode("ascii")

    async def request(self, method: str, target: str, headers: list[tuple[str, str]],
                      body: bytes | None, answer: Answer) -> None:
        """Send one request and read its whole answer into `answer` (module docstring)."""
        connection = self._take_idle()
        if connection is None:
            connection = await self._open()
        done = False
        try:
            await self._exchange(connection, method, target, headers, body, answer)
            done = True
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError,
                h11.ProtocolError) as exc:
            raise TransportError(f"{self._where}: {describe(exc)}") from exc
        finally:
            if done and connection.protocol.our_state is h11.DONE \
                    and connection.protocol.their_state is h11.DONE \
                    and len(self._idle) < self.max_idle:
                connection.protocol.start_next_cycle()
                connection.idle_since = trio.current_time()
                self._idle.append(connection)
            else:
                await trio.aclose_forcefully(connection.stream)

    async def aclose(self) -> None:
        """Close the idle connections (a request under way closes its own)."""
        idle, self._idle = self._idle, []
        for connection in idle:
            await trio.aclose_forcefully(connection.stream)

    @property
    def _where(self) -> str:
        return f"{self.host}:{self.port}"

    def _take_idle(self) -> _Connection | None:
        """The newest idle connection the server cannot have closed; stale ones are dropped."""
        expired = trio.current_time() - IDLE_EXPIRY_S
        while self._idle:
            connection = self._idle.pop()
            if connection.idle_since > expired and not connection.socket.is_readable():
                return connection
            _close_now(connection)
        return None

    async def _open(self) -> _Connection:
        try:
            tcp = await trio.open_tcp_stream(self.host, self.port)
        except OSError as exc:
            raise TransportError(f"cannot connect to {self._where}: {describe(exc)}") from exc
        stream: trio.abc.Stream = tcp
        if self.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            stream = trio.SSLStream(tcp, self._ssl, server_hostname=self.host,
                                    https_compatible=True)
            try:
                await stream.do_handshake()
            except (OSError, trio.BrokenResourceError) as exc:
                await trio.aclose_forcefully(stream)
                raise TransportError(
                    f"TLS with {self._where} failed: {describe(exc)}") from exc
        return _Connection(stream, tcp.socket, h11.Connection(h11.CLIENT))

    async def _exchange(self, connection: _Connection, method: str, target: str,
                        headers: list[tuple[str, str]], body: bytes | None,
                        answer: Answer) -> None:
        protocol = connection.protocol
        head = [(b"host", self._host_header)]
        head.extend((name.encode("latin-1"), value.encode("latin-1")) for name, value in headers)
        if body is not None:
            head.append((b"content-length", str(len(body)).encode("ascii")))
        data = protocol.send(h11.Request(method=method, target=target, headers=head))
        if body:
            data += protocol.send(h11.Data(data=body))
        data += protocol.send(h11.EndOfMessage())
        await connection.stream.send_all(data)
        chunks: list[bytes] = []
        while True:
            event = protocol.next_event()
            if event is h11.NEED_DATA:
                protocol.receive_data(await connection.stream.receive_some(READ_BYTES))
            elif type(event) is h11.Response:
                answer.status = event.status_code
                answer.headers = {name.decode("latin-1"): value.decode("latin-1")
                                  for name, value in event.headers}  # h11 lower-cases names
            elif type(event) is h11.Data:
                chunks.append(bytes(event.data))
            elif type(event) is h11.EndOfMessage:
                answer.body = b"".join(chunks)
                return
            elif type(event) is h11.ConnectionClosed:
                raise trio.BrokenResourceError("the server closed the connection mid-answer")


def _close_now(connection: _Connection) -> None:
    """Close a connection without waiting (an idle one: nothing is under way on it)."""
    connection.socket.close()
