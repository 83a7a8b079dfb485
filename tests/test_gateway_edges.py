"""The gateway client at the edges of its transport, against a stub HTTP server written here.

The stub is a raw trio socket server on 127.0.0.1:0 (no database): it parses each request,
records it (path, request id, body, arrival time) and answers whatever the test's `reply`
returns — a full HTTP answer, a status line and headers followed by a cut body, or nothing at
all (the connection closed before a status line, which the client counts as unreachable).
Everything else is the real client: `open_gateway`, its retry policy, paging and codecs.
"""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any, Awaitable, Callable

import attrs
import pytest
import trio

from runplane.engine import RunRef, RunScope, runs, sheets
from runplane.engine.actions import actions
from runplane.engine.errors import ConflictError, GatewayUnavailableError, StoreUnavailableError
from runplane.engine.gateway import RetryPolicy, mint_token, open_gateway
from runplane.engine.gateway.protocol import HEALTH_HEADER, PAGE_HEADROOM, REQUEST_ID_HEADER
from runplane.engine.sheets.model import Admission, AdmittedRow, Completion

ORG = "edges-org"
TOKEN = mint_token("stub-secret-" + "x" * 32, ORG)
PLAY = "edges"
CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))
LADDER = RetryPolicy(answered_delays_s=(0.01, 0.01, 0.01), unreachable_budget_s=20.0)
CLOSE = object()  # a reply: close the connection before any status line


@attrs.frozen
class Request:
    path: str
    request_id: str | None
    body: Any
    at: float


def answer(status: int, payload: Any, *, raw: bytes | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(payload).encode()
    return (f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def result_of(action_name: str, value: Any) -> bytes:
    return answer(200, {"result": actions()[action_name].result.encode(value, "result")})


async def _read_request(stream: trio.SocketStream) -> tuple[str, dict[str, str], bytes] | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((name.strip().lower(), value.strip())
                   for name, _, value in (line.partition(":") for line in lines[1:]))
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        body += chunk
    return lines[0].split(" ")[1], headers, body


@contextlib.asynccontextmanager
async def stub(reply: Callable[[Request, list[Request]], Awaitable[Any]], body_limit: int = 100_000):
    """A stub gateway at a URL; `reply(request, seen_actions)` answers each action request.
    Health always answers `body_limit`. Yields (url, the action requests seen, in order)."""
    seen: list[Request] = []

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            parsed = await _read_request(stream)
            if parsed is None:
                return
            path, headers, body = parsed
            if path == "/v1/health":
                await stream.send_all(answer(200, {"ok": True, "version": "stub",
                                                   "body_limit": body_limit, "array_actions": True}))
                return
            request = Request(path, headers.get(REQUEST_ID_HEADER), json.loads(body or b"null"),
                              trio.current_time())
            seen.append(request)
            out = await reply(request, seen)
            if out is not CLOSE:
                await stream.send_all(out)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}", seen
        nursery.cancel_scope.cancel()


RUN = RunRef(RunScope(ORG, PLAY, "r"), 3)


async def test_a_body_cut_after_the_status_line_is_an_answered_attempt_that_is_retried():
    async def reply(request, seen):
        if len(seen) == 1:  # a status line and headers promising 200 bytes, then 9 and a close
            return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: 200\r\nconnection: close\r\n\r\n{\"result\"")
        return result_of("runs.register", RUN)

    async with stub(reply) as (url, seen):
        async with open_gateway(url, TOKEN, retry=LADDER) as gw:
            run = await runs.register(gw, RUN.scope)
            stats = (gw.stats.answered_attempts, gw.stats.unanswered_attempts)
    assert run == RUN
    # Two action attempts, both answered: the cut body spent a ladder step. (No health read:
    # the first action asked for it, and nothing needed it when the stub did not answer it.)
    assert len(seen) == 2 and stats == (2, 0)
    assert seen[0].request_id is not None and seen[0].request_id == seen[1].request_id


@pytest.mark.parametrize("value", ["{not json", "[1, 2]", "\"ok\"", "{\"version\": \"x\"}",
                                   "{\"body_limit\": \"many\"}"])
async def test_a_health_header_that_is_not_a_health_answer_is_ignored_and_health_is_read(value):
    # The first action asks for the health; a value the client cannot read leaves it unknown,
    # and the client reads `GET /v1/health` when it needs it (not a crash, not a wrong limit).
    async def reply(request, seen):
        head, _, rest = result_of("runs.register", RUN).partition(b"\r\n")
        return head + f"\r\n{HEALTH_HEADER}: {value}".encode() + b"\r\n" + rest

    async with stub(reply, body_limit=54_321) as (url, seen):
        async with open_gateway(url, TOKEN, retry=LADDER) as gw:
            run = await runs.register(gw, RUN.scope)
            assert gw.stats.answered_attempts == 1
            health = await gw.health()
            stats = (gw.stats.answered_attempts, gw.stats.unanswered_attempts)
    assert run == RUN and health.body_limit == 54_321 and health.version == "stub"
    assert len(seen) == 1 and stats == (2, 0)  # the action, then the health read


@pytest.mark.parametrize("raw", [b"<html>proxy error</html>", b"[1, 2]", b"{\"result\"",
                                 b"{\"ok\": true}"])
async def test_a_200_that_is_not_an_answer_is_a_typed_error_not_a_crash(raw):
    async def reply(request, seen):
        return answer(200, None, raw=raw)

    async with stub(reply) as (url, seen):
        async with open_gateway(url, TOKEN, retry=LADDER) as gw:
            with pytest.raises(GatewayUnavailableError) as raised:
                await runs.register(gw, RUN.scope)
    assert "HTTP 200" in str(raised.value) and url in str(raised.value)
    # Not JSON (perhaps cut by a proxy) spends the ladder; a JSON object without a result
    # is a server that does not speak this protocol: no retry helps.
    assert len(seen) == (1 if raw == b"{\"ok\": true}" else 4)
    assert len({request.request_id for request in seen}) == 1


async def test_a_503_with_retry_after_ms_is_waited_out_and_retried_with_the_same_request_id():
    async def reply(request, seen):
        if len(seen) == 1:
            return answer(503, {"error": "the server's deadline ran out", "code": "store_unavailable",
                                "retry_after_ms": 400})
        return result_of("runs.register", RUN)

    async with stub(reply) as (url, seen):
        async with open_gateway(url, TOKEN, retry=LADDER) as gw:  # its ladder waits 0.01 s
            run = await runs.register(gw, RUN.scope)
    assert run == RUN and len(seen) == 2
    assert seen[1].at - seen[0].at >= 0.4  # the server's wait, not the ladder's step
    assert seen[0].request_id is not None and seen[0].request_id == seen[1].request_id


async def test_time_spent_unreachable_extends_a_completions_total_deadline():
    # The total deadline (0.5 s) passes while the stub drops connections before any status
    # line (1 s); the time spent unreachable extends it, so the answer that then comes counts.
    policy = RetryPolicy(answered_delays_s=(0.05,), unreachable_budget_s=20.0,
                         completion_total_s=0.5)
    done = Completion(updated=1, committed_keys=("k",), fenced=())

    async def reply(request, seen):
        if request.at - seen[0].at < 1.0:
            return CLOSE
        return result_of("sheets.complete", done)

    async with stub(reply) as (url, seen):
        async with open_gateway(url, TOKEN, retry=policy) as gw:
            outcome = sheets.RowOutcome("k", "completed", {"upper": "K"})
            completion = await sheets.complete(gw, RUN, "t", CONTRACT, [outcome])
            stats = (gw.stats.answered_attempts, gw.stats.unanswered_attempts)
    assert completion.updated == 1 and completion.committed_keys == ("k",)
    assert stats[0] == 2 and stats[1] == len(seen) - 1 >= 2  # health + the one answered attempt
    assert len({request.request_id for request in seen}) == 1


async def test_a_completion_unreachable_then_answered_busy_still_stops_at_its_deadline():
    policy = RetryPolicy(answered_delays_s=(0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2),
                         unreachable_budget_s=20.0, completion_total_s=0.5)

    async def reply(request, seen):
        if request.at - seen[0].at < 0.5:
            return CLOSE
        return answer(503, {"error": "busy", "code": "store_unavailable"})

    async with stub(reply) as (url, seen):
        async with open_gateway(url, TOKEN, retry=policy) as gw:
            outcome = sheets.RowOutcome("k", "completed", {"upper": "K"})
            with pytest.raises(GatewayUnavailableError, match="completion deadline of 0.5 s"):
                await sheets.complete(gw, RUN, "t", CONTRACT, [outcome])
            answered = gw.stats.answered_attempts - 1  # less the health read
    # Answered attempts stop when the extended deadline passes, before the ladder's 9.
    assert 1 <= answered < 9 and sum(1 for r in seen if r.at - seen[0].at >= 0.5) == answered


ROWS = [{"name": f"name-{i:03d}-" + "x" * 40} for i in range(60)]
PAGED_LIMIT = PAGE_HEADROOM + 1500  # room for about 20 rows a page


def honest_page(request: Request) -> Admission:
    """What a consistent gateway answers for one page: every row new and pending."""
    body = request.body
    pending = tuple(AdmittedRow(key, index, {})
                    for key, index in zip(body["keys"], body["input_indexes"]))
    return Admission(inserted=len(pending), skipped=0, pending=pending, completed=(), blocked=(),
                     write_version=RUN.epoch)


async def test_pages_of_one_admission_that_agree_are_merged():
    async def reply(request, seen):
        return result_of("sheets.admit", honest_page(request))

    async with stub(reply, body_limit=PAGED_LIMIT) as (url, seen):
        async with open_gateway(url, TOKEN, retry=LADDER) as gw:
            admission = await sheets.admit(gw, RUN, "t", CONTRACT, ROWS)
    assert len(seen) >= 3 and len({request.request_id for request in seen}) == len(seen)
    assert admission.inserted == 60 and admission.write_version == RUN.epoch
    assert [row.row for row in admission.pending] == ROWS  # the client put its rows back
    assert [row.input_index for row in admission.pending] == list(range(60))


def other_version(page: Admission, body: dict) -> Admission:
    return attrs.evolve(page, write_version=RUN.epoch + 1)


def more_inserted_than_pending(page: Admission, body: dict) -> Admission:
    return attrs.evolve(page, inserted=page.inserted + 1)


def a_row_this_page_did_not_send(page: Admission, body: dict) -> Admission:
    return attrs.evolve(page, pending=(*page.pending[1:], AdmittedRow("not-sent", 0, {})))


def a_row_at_another_index(page: Admission, body: dict) -> Admission:
    first = page.pending[0]
    return attrs.evolve(page, pending=(AdmittedRow(first.key, first.input_index + 1000, {}),
                                       *page.pending[1:]))


def a_row_twice(page: Admission, body: dict) -> Admission:
    first = page.pending[0]
    return attrs.evolve(page, pending=page.pending[1:],
                        completed=(AdmittedRow(first.key, first.input_index, {}),),
                        blocked=(sheets.BlockedRow(first.key, first.input_index, "gave_up"),),
                        inserted=page.inserted - 1, cached=1)


def more_cached_than_sent(page: Admission, body: dict) -> Admission:
    return attrs.evolve(page, cached=len(body["keys"]) + 1)


@pytest.mark.parametrize("skew", [other_version, more_inserted_than_pending,
                                  a_row_this_page_did_not_send, a_row_at_another_index,
                                  a_row_twice, more_cached_than_sent])
async def test_a_page_that_disagrees_with_what_the_call_sent_is_a_conflict(skew):
    async def reply(request, seen):
        page = honest_page(request)
        if len(seen) == 2:  # the second page of the call
            page = skew(page, request.body)
        return result_of("sheets.admit", page)

    async with stub(reply, body_limit=PAGED_LIMIT) as (url, seen):
        async with open_gateway(url, TOKEN, retry=LADDER) as gw:
            with pytest.raises(ConflictError, match="page"):
                await sheets.admit(gw, RUN, "t", CONTRACT, ROWS)
    assert len(seen) == 2  # no page is sent after the one that disagreed
