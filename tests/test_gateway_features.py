"""A newer runner and an older gateway: the runner sends a newer form of a request only to a
gateway whose health lists it (`protocol.FEATURES`, `protocol.ARRAY_FEATURES`), and otherwise
the older requests, to the same rows."""

from __future__ import annotations

import attrs
import pytest

from runplane.actors import open_run
from runplane.engine import PlayScope, RunScope, array_input, runs, sheets
from runplane.engine.actions import actions
from runplane.engine.errors import ConflictError, InvalidInputError
from runplane.engine.gateway import open_gateway, protocol, senders
from runplane.engine.sheets.model import ADMISSION, Admission, AdmittedRow

from .gateway_support import FAST_RETRY, serving, token_for
from .run_helpers import outbox_state
from .test_gateway_map import CONTRACT, comparable, rows, run_map

OLDER_REFUSES = (("array_input.put_and_seal", "has_source_identities"),
                 ("array_input.retire_entry", "record_lease_s"),
                 ("sheets.admit", "expect_new"))


def as_an_older_gateway(monkeypatch) -> None:
    """The gateway answers as one from before `open_list_map`, `put_and_seal`'s begin fields,
    `retire_entry`'s `record_lease_s`, `sheets.admit`'s `expect_new` and its pending rows by
    index: its health lists no features, it refuses those fields as unknown, and it answers
    an unknown rows form in full."""
    from runplane.engine.actions import Action

    decode_input = Action.decode_input

    def as_before(self, body):
        for name, field in OLDER_REFUSES:
            if self.name == name and field in body:
                raise InvalidInputError(f"{self.name}: unknown input fields [{field!r}]")
        return decode_input(self, body)

    monkeypatch.setattr(protocol, "ARRAY_FEATURES", ())
    monkeypatch.setattr(protocol, "FEATURES", ())
    monkeypatch.setattr(protocol, "ROWS_FORMS", frozenset({protocol.ROWS_BY_KEY}))
    monkeypatch.setattr(Action, "decode_input", as_before)


def admissions_seen(monkeypatch) -> list[bool]:
    """Whether each `sheets.admit` body the gateway decodes carries `expect_new` (appended)."""
    from runplane.engine.actions import Action

    seen: list[bool] = []
    decode_input = Action.decode_input

    def noting(self, body):
        if self.name == "sheets.admit":
            seen.append(body.get("expect_new", False))
        return decode_input(self, body)

    monkeypatch.setattr(Action, "decode_input", noting)
    return seen


async def test_a_newer_runner_maps_a_small_list_through_an_older_gateway(tenant, monkeypatch):
    """A gateway whose health lists no features (one from before `open_list_map` and
    `put_and_seal`'s begin fields, which refuses those fields as unknown) serves a newer
    runner's one-page list map: the runner opens it with the three calls, begins the input
    in a request of its own and records its run's terminal entry before retiring it, to the
    same rows and the same settled entry as a gateway that lists them."""
    async def mapped(play: str) -> dict[str, int]:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
            before = dict(server.requests)
            run, result = await run_map(gw, play, rows(40))
            assert (result.admitted, result.failed) == (40, 6)
        assert await outbox_state(tenant, run.run_id) == "done"
        return {name: server.requests[name] - before.get(name, 0) for name in server.requests}

    async with serving(tenant) as server:
        newer = await mapped("newer")
        as_an_older_gateway(monkeypatch)
        older = await mapped("older")
    assert (newer["array_input.open_list_map"], newer.get("array_input.begin", 0)) == (1, 0)
    assert (older.get("array_input.open_list_map", 0), older["array_input.begin"]) == (0, 1)
    assert older["array_input.put_and_seal"] == 1 and older["sheets.ensure_sheet"] == 1
    assert (newer.get("outbox.mark_pending", 0), newer["array_input.retire_entry"]) == (0, 1)
    assert (older["outbox.mark_pending"], older["array_input.retire_entry"]) == (1, 1)
    stored = [comparable(await sheets.read_rows(tenant, PlayScope(tenant.org_id, play), "things"))
              for play in ("newer", "older")]
    assert stored[0] == stored[1]


async def test_an_older_gateway_puts_and_seals_a_one_page_list_already_begun(tenant, monkeypatch):
    """A one-page list whose begin fact is written already (a wake of a map that began its
    staging) is put and sealed through an older gateway in one request without the begin
    fields, and not begun again."""
    from runplane.actors.sealer import stage_encoded

    source = array_input.encode_source(rows(20))
    async with serving(tenant) as server:
        as_an_older_gateway(monkeypatch)
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
            async with open_run(gw, "begun", "run-b", retire_on_exit=False) as run:
                scope = run.scope.map("things", "map-0")
                await array_input.begin(
                    gw, scope, source_fingerprint=source.fingerprint,
                    source_rows=source.source_rows,
                    has_source_identities=source.has_source_identities)
                before = dict(server.requests)
                staged = await stage_encoded(gw, scope, source)
                sent = {name: count - before.get(name, 0)
                        for name, count in server.requests.items() if count > before.get(name, 0)}
    assert (staged.manifest.state, staged.manifest.source_rows) == ("sealed", 20)
    assert sent == {"array_input.get_manifest": 1, "array_input.put_and_seal": 1}


async def test_units_sent_ahead_travel_as_rows_expected_new_to_a_gateway_that_lists_it(
        tenant, monkeypatch):
    """A streamed map's units sent ahead are admitted as rows expected new through a gateway
    that lists `sheets.admit:expect_new`; through an older one the field is not sent (it
    would be refused) and the map ends with the same rows."""
    async def stream():
        for row in rows(2500):
            yield row

    async def mapped(play: str) -> list[bool]:
        seen = admissions_seen(monkeypatch)
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
            _, result = await run_map(gw, play, stream())
        assert (result.admitted, result.completed + result.failed) == (2500, 2500)
        monkeypatch.undo()
        return seen

    async with serving(tenant) as server:
        newer = await mapped("newer")
        as_an_older_gateway(monkeypatch)
        older = await mapped("older")
    assert any(newer) and not any(older)
    stored = [comparable(await sheets.read_rows(tenant, PlayScope(tenant.org_id, play), "things"))
              for play in ("newer", "older")]
    assert stored[0] == stored[1]


async def test_rows_expected_new_that_exist_are_admitted_as_ordinary_through_a_gateway(
        tenant, monkeypatch):
    """A batch sent as rows expected new that meets rows already in the sheet is admitted the
    ordinary way by the gateway: the same outcome as the batch admitted without the hint."""
    seen = admissions_seen(monkeypatch)
    async with serving(tenant) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
            answers = []
            for play, expect_new in (("hinted", True), ("plain", False)):
                run = await runs.register(gw, RunScope(tenant.org_id, play, "r"))
                await sheets.admit(gw, run, "t", CONTRACT, rows(3))
                answers.append(await sheets.admit(gw, run, "t", CONTRACT, rows(5),
                                                  expect_new=expect_new))
    assert seen == [False, True, False, False]  # the hint reached the gateway
    hinted, plain = answers
    assert (hinted.inserted, hinted.skipped) == (plain.inserted, plain.skipped) == (2, 0)
    assert [row.key for row in hinted.pending] == [row.key for row in plain.pending]
    assert len(hinted.pending) == 5


def answer_forms(monkeypatch) -> list[str | None]:
    """The rows form of each admission answer the gateway writes (appended)."""
    from runplane.engine.gateway import server as gateway_server

    forms: list[str | None] = []
    encode_result = gateway_server.encode_result

    def noting(spec, result, skipped, rows_form):
        if spec.name == "sheets.admit":
            forms.append(rows_form)
        return encode_result(spec, result, skipped, rows_form)

    monkeypatch.setattr(gateway_server, "encode_result", noting)
    return forms


async def test_pending_rows_come_back_as_input_indexes_from_a_gateway_that_lists_it(
        tenant, monkeypatch):
    """A map's admissions through a gateway that lists `sheets.admit:by-index` are answered
    with pending rows as input indexes alone; through an older one, by key; the same rows
    either way, and the same as direct."""
    async def stream():
        for row in rows(2500):
            yield row

    async def mapped(port, play: str) -> None:
        _, result = await run_map(port, play, stream())
        assert (result.admitted, result.completed + result.failed) == (2500, 2500)

    async with serving(tenant) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
            newer = answer_forms(monkeypatch)
            await mapped(gw, "newer")
            monkeypatch.undo()
        as_an_older_gateway(monkeypatch)
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
            older = answer_forms(monkeypatch)
            await mapped(gw, "older")
    await mapped(tenant, "direct")
    assert newer and set(newer) == {protocol.ROWS_BY_INDEX}
    assert older and set(older) == {protocol.ROWS_BY_KEY}
    stored = [comparable(await sheets.read_rows(tenant, PlayScope(tenant.org_id, play), "things"))
              for play in ("newer", "older", "direct")]
    assert stored[0] == stored[1] == stored[2]


def test_an_answer_by_index_is_refused_unless_every_index_was_sent():
    """A pending row answered at an input index the page did not send, or twice, is refused
    as a page that disagrees with what was sent."""
    action = actions()["sheets.admit"]
    key_at = {10: "k10", 11: "k11"}
    row_of = {"k10": {"n": 10}, "k11": {"n": 11}}
    sent = {"k10": 10, "k11": 11}

    def answer(pending: list) -> dict:
        return {**ADMISSION.encode(Admission(inserted=len(pending), skipped=0, pending=(),
                                             completed=(), blocked=(), write_version=3),
                                   "result"), "pending": pending}

    page = senders.decode_admitted_page(action, answer([11, 10]), row_of, key_at)
    assert [(row.key, row.input_index, row.row) for row in page.pending] == [
        ("k11", 11, {"n": 11}), ("k10", 10, {"n": 10})]
    senders.paging.check_admitted_page(page, sent, 3)
    with pytest.raises(ConflictError, match="input index 12 was not sent"):
        senders.decode_admitted_page(action, answer([10, 12]), row_of, key_at)
    twice = senders.decode_admitted_page(action, answer([10, 10]), row_of, key_at)
    with pytest.raises(ConflictError, match="listed twice"):
        senders.paging.check_admitted_page(twice, sent, 3)
    moved = attrs.evolve(page, pending=(AdmittedRow("k10", 10, {}), AdmittedRow("k11", 10, {})))
    with pytest.raises(ConflictError, match="row 'k11' at input index 10 was not sent"):
        senders.paging.check_admitted_page(moved, sent, 3)

