"""Maps, sheets and array inputs through a gateway: the same rows, counters, cache and
retirement as direct; paging under a small body limit; the array fallback."""

from __future__ import annotations

import json
import logging

import pytest
import trio

from runplane.actors import open_run, open_supervisor
from runplane.engine import PlayScope, RunScope, array_input, runs, sheets
from runplane.engine.errors import ArrayInputUnavailableError, InvalidInputError
from runplane.engine.array_input.pages import encode_page
from runplane.engine.gateway import open_gateway, protocol
from runplane.engine.gateway import server as server_module
from runplane.engine.sheets import StagedPage

from .array_input_support import stage
from .gateway_support import FAST_RETRY, count_rows, gateway, server, serving, token_for  # noqa: F401
from .run_helpers import fact_kinds, outbox_state
from .sheet_helpers import counters_match

CONTRACT = sheets.SheetContract(inputs=("name", "n"), outputs=("upper", "half"))


def rows(n: int) -> list[dict]:
    return [{"name": f"row-{i}", "n": i} for i in range(n)]


async def enrich(row: dict) -> dict:
    if row["n"] % 7 == 3:
        raise ValueError(f"no luck for {row['name']}")
    return {"upper": row["name"].upper(), "half": row["n"] / 2}


def comparable(stored: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "_key"} for row in stored]


async def run_map(port, play: str, source, **options):
    async with open_run(port, play) as run:
        result = await run.map("things", source, enrich, contract=CONTRACT, concurrency=8, **options)
    return run, result


async def test_a_map_through_the_gateway_equals_the_same_map_direct(tenant, gateway):
    source = rows(300)
    direct_run, direct = await run_map(tenant, "direct", source)
    remote_run, remote = await run_map(gateway, "remote", source)
    for result in (direct, remote):
        assert (result.admitted, result.cached, result.completed, result.failed) == (300, 0, 257, 43)
    stored = {}
    for play, run in (("direct", direct_run), ("remote", remote_run)):
        scope = PlayScope(tenant.org_id, play)
        stored[play] = await sheets.read_rows(tenant, scope, "things")
        assert await sheets.summary(gateway, scope, "things") == await sheets.summary(tenant, scope, "things")
        assert (await counters_match(tenant, scope, "things"))[0]
        # retirement: the run's staged input is gone and its outbox entry is done
        assert await fact_kinds(tenant, run.run_id) == ["array_input_guard"]
        assert await outbox_state(tenant, run.run_id) == "done"
    assert comparable(stored["remote"]) == comparable(stored["direct"])
    assert [row["_key"] for row in stored["remote"]] == [row["_key"] for row in stored["direct"]]
    # A rerun through the gateway finds the cache: only the failed rows run again.
    _, again = await run_map(gateway, "remote", source)
    assert (again.cached, again.completed + again.failed) == (257, 43)
    # An async-iterable source is admitted page by page, through the gateway too.

    async def stream():
        for row in rows(120):
            yield row

    _, streamed = await run_map(gateway, "streamed", stream())
    assert (streamed.admitted, streamed.completed, streamed.failed) == (120, 103, 17)


async def test_a_supervisor_hosts_runs_through_the_gateway(tenant, gateway):
    async with open_supervisor(gateway) as sup:
        async def body(run):
            return await run.map("things", rows(20), enrich, contract=CONTRACT)

        result = await sup.run("supervised", body)
    assert result.completed + result.failed == 20
    assert await count_rows(tenant, "terminal_outbox") == 1


async def test_sheets_and_array_inputs_answer_as_direct(tenant, gateway):
    scope = PlayScope(tenant.org_id, "sheets")
    await sheets.ensure_sheet(gateway, scope, "t", CONTRACT)
    run = await runs.register(gateway, RunScope(tenant.org_id, "sheets", "r"))
    admitted = await sheets.admit(gateway, run, "t", CONTRACT, rows(5) + rows(2), input_offset=10)
    assert (admitted.inserted, admitted.skipped, admitted.write_version) == (5, 2, run.epoch)
    assert [row.input_index for row in admitted.pending] == [10, 11, 12, 13, 14]
    outcomes = [sheets.RowOutcome(row.key, "completed", {"upper": "X", "half": 0},
                                 input_index=row.input_index)
                for row in admitted.pending[:3]]
    outcomes.append(sheets.RowOutcome(admitted.pending[4].key, "failed", error="boom"))
    seen = []
    done = await sheets.complete(gateway, run, "t", CONTRACT, outcomes, on_diagnostics=seen.append)
    assert done.committed_keys == tuple(o.key for o in outcomes) and done.updated == 4
    await gateway.diagnostics.wait_idle()  # the sink runs in the gateway's background task
    assert len(seen) == 1 and seen[0].input_rows == 4
    again = await sheets.admit(gateway, run, "t", CONTRACT, rows(5))
    assert len(again.completed) == 3 and again.completed[0].row["upper"] == "X"
    read = await sheets.read_rows(gateway, scope, "t", run_id="r")
    assert read == await sheets.read_rows(tenant, scope, "t", run_id="r")

    occurrences = [array_input.Occurrence({"i": i}, {"dataset_id": "d", "row_index": i})
                   for i in range(2500)]
    map_scope = run.scope.map("t", "m")
    fingerprint = array_input.source_fingerprint(occurrences)
    drafts = array_input.paginate(occurrences)
    await array_input.begin(gateway, map_scope, source_fingerprint=fingerprint, source_rows=2500,
                            has_source_identities=True)
    for draft in drafts:
        await array_input.put_page(gateway, map_scope, source_fingerprint=fingerprint,
                                   ordinal=draft.ordinal, offset=draft.offset, rows=draft.rows)
    await array_input.seal(gateway, map_scope, source_fingerprint=fingerprint, source_rows=2500,
                           page_count=len(drafts))
    manifest = await array_input.get_manifest(gateway, map_scope)
    assert manifest == await array_input.get_manifest(tenant, map_scope)
    assert manifest.state == "sealed" and manifest.page_count == len(drafts)
    page = await array_input.read_page(gateway, map_scope, 1)
    assert page == await array_input.read_page(tenant, map_scope, 1)
    assert page.rows[0].source_identity.row_index == 1000
    retired = await array_input.retire(gateway, run.scope)
    assert retired.done and retired.deleted == 2 + len(drafts)


async def test_a_one_page_list_is_admitted_in_one_request_from_its_staged_page(
        tenant, gateway, server):
    """A list of one staged page (1,000 rows at most) has no ramp of small first units: it is
    admitted in one request, from the page it staged (its rows are not sent again); one row
    more, two pages, and the ramp's first unit (100 rows) goes first, in a request of its own."""
    async def fast(row):
        return {"upper": row["name"].upper(), "half": row["n"] / 2}

    for size, one_request in ((1000, True), (1001, False)):
        before = server.requests["sheets.admit"]
        async with open_run(gateway, f"one-page-{size}") as run:
            result = await run.map("things", rows(size), fast, contract=CONTRACT)
        assert (result.admitted, result.completed) == (size, size)
        assert (server.requests["sheets.admit"] - before == 1) == one_request, size
        scope = PlayScope(tenant.org_id, f"one-page-{size}")
        assert (await counters_match(tenant, scope, "things"))[0]
        assert await fact_kinds(tenant, run.run_id) == ["array_input_guard"]  # retired


@pytest.mark.parametrize("rows_listed", [True, False])
async def test_a_staged_pages_pending_rows_come_back_as_indexes(tenant, monkeypatch,
                                                                 rows_listed):
    """An admission from a staged page through a gateway is answered with its pending rows as
    input indexes alone (the client has the rows; with them in full, 1,000 rows travelled
    back and were decoded row by row), and the client's admission is the direct one's: the
    same keys, indexes and rows, a row repeated in the page skipped. A gateway that does not
    list the form answers by key, to the same admission."""
    forms = []
    encode = server_module.encode_result

    def recorded(spec, result, skipped, rows_form):
        body = encode(spec, result, skipped, rows_form)
        if spec.name == "sheets.admit":
            forms.append((rows_form, json.loads(body)["result"]["pending"]))
        return body

    monkeypatch.setattr(server_module, "encode_result", recorded)
    if not rows_listed:
        monkeypatch.setattr(protocol, "FEATURES", tuple(
            f for f in protocol.FEATURES if f != protocol.ADMIT_BY_INDEX))
    source = rows(30) + rows(2)  # the last two repeat the first two
    admitted = []
    async with serving(tenant) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
            for port, play in ((gw, "staged-gw"), (tenant, "staged-direct")):
                run = await runs.register(port, RunScope(tenant.org_id, play, "r1"))
                scope = run.scope.map("t", "map-0")
                fingerprint, drafts = await stage(
                    tenant, scope, [array_input.Occurrence(row) for row in source])
                (draft,) = drafts
                digest = encode_page(fingerprint, 0, draft.offset, draft.rows).digest
                admitted.append(await sheets.admit(port, run, "t", CONTRACT, source,
                                                   staged_page=StagedPage(scope, 0, digest)))
    through, direct = admitted
    assert [(r.key, r.input_index, r.row) for r in through.pending] == \
        [(r.key, r.input_index, r.row) for r in direct.pending]
    assert (through.inserted, through.skipped) == (direct.inserted, direct.skipped) == (30, 2)
    (form, pending), = forms
    if rows_listed:
        assert (form, pending) == (protocol.ROWS_BY_INDEX, list(range(30)))
    else:
        assert form == protocol.ROWS_BY_KEY
        assert [row["row"] for row in pending] == [{}] * 30


async def test_paging_under_a_small_body_limit_changes_no_outcome(tenant):
    limit = 12_000
    source = [{"name": f"row-{i % 150}", "n": i % 150, "pad": "p" * (i % 150 % 40)}
              for i in range(400)]
    keys_play = PlayScope(tenant.org_id, "paged")
    async with serving(tenant, body_limit=limit) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
            await sheets.ensure_sheet(gw, keys_play, "t", CONTRACT)
            run = await runs.register(gw, RunScope(tenant.org_id, "paged", "r"))
            paged = await sheets.admit(gw, run, "t", CONTRACT, source, input_offset=5)
            assert server.requests["sheets.admit"] > 1  # it really was paged
            direct_run = await runs.register(tenant, RunScope(tenant.org_id, "paged-direct", "r"))
            direct = await sheets.admit(tenant, direct_run, "t", CONTRACT, source, input_offset=5)
            assert (paged.inserted, paged.skipped) == (direct.inserted, direct.skipped)
            assert [(r.key, r.input_index, r.row) for r in paged.pending] == \
                [(r.key, r.input_index, r.row) for r in direct.pending]
            outcomes = [sheets.RowOutcome(r.key, "completed", {"upper": "u" * 50, "half": i})
                        for i, r in enumerate(paged.pending)]
            before = server.requests["sheets.complete"]
            completion = await sheets.complete(gw, run, "t", CONTRACT, outcomes)
            assert server.requests["sheets.complete"] - before > 1
            assert completion.committed_keys == tuple(o.key for o in outcomes)
            assert completion.diagnostics.input_rows == len(outcomes)
            summary = await sheets.summary(tenant, keys_play, "t")
            assert (summary.total, summary.completed) == (150, 150)
            assert (await counters_match(tenant, keys_play, "t"))[0]
            assert server.max_body_bytes <= limit
            # One row that cannot fit alone: refused naming its index, nothing sent.
            sent = sum(server.requests.values())
            huge = source[:3] + [{"name": "big", "n": 1, "pad": "x" * limit}]
            with pytest.raises(InvalidInputError, match=r"rows\[3\]"):
                await sheets.admit(gw, run, "t", CONTRACT, huge)
            wide = sheets.SheetContract(  # within the field limits, but a fixed part over the body limit
                inputs=("name",), outputs=tuple(f"o{i:05d}" + "x" * 200 for i in range(300)))
            with pytest.raises(InvalidInputError, match="fixed part"):
                await sheets.admit(gw, run, "t", wide, source[:1])
            assert sum(server.requests.values()) == sent
    assert await count_rows(tenant, "runs") == 2


async def test_an_old_gateway_without_array_actions_falls_back_to_direct_admission(tenant, caplog):
    caplog.set_level(logging.WARNING, logger="runplane.actors")
    async with serving(tenant, array_actions=False) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
            async with open_run(gw, "old", retire_on_exit=False) as run:
                with pytest.raises(ArrayInputUnavailableError):
                    await run.stage_array("things", "m", [{"a": 1}])
                result = await run.map("things", rows(50), enrich, contract=CONTRACT)
                again = await run.map("things", rows(50), enrich, contract=CONTRACT)
    assert (result.admitted, result.completed, result.failed) == (50, 43, 7)
    assert again.cached == 43
    assert await fact_kinds(tenant, run.run_id) == []
    warnings = [r for r in caplog.records if "re-read" in r.getMessage()]
    assert len(warnings) == 2  # one per map
    assert server.errors["unsupported_action"] >= 2
    assert server.requests.get("array_input.open_list_map", 0) == 0  # its health lists none


async def test_a_small_list_map_opens_and_stages_in_one_request_each(tenant):
    """Through a gateway a list map's sheet, manifest and row count are one request
    (`array_input.open_list_map`) and a one-page list is begun, put and sealed in one
    (`array_input.put_and_seal`), with no probe into a sheet that held no row; a token that does not allow the opening action opens the map
    with the three calls instead, to the same rows, without sending the action it cannot
    (no 403 a map)."""
    opening = ("sheets.ensure_sheet", "array_input.get_manifest", "sheets.summary")
    async with serving(tenant) as server:
        for play, claims in (("one", {}), ("three", {"actions": [
                "runs.*", "sheets.*", "history.*", "outbox.*", "row_calls.*",
                "array_input.get_manifest", "array_input.begin", "array_input.put_and_seal",
                "array_input.retire_entry", "array_input.read_page"]})):
            async with open_gateway(server.url, token_for(tenant, **claims),
                                    retry=FAST_RETRY) as gw:
                before = dict(server.requests)
                staged, probed = [], []  # put_and_seal and probe requests of each map
                for _ in range(2):  # the second map: a rerun into a sheet with rows
                    puts = server.requests.get("array_input.put_and_seal", 0)
                    probes = server.requests.get("sheets.probe", 0)
                    _, result = await run_map(gw, play, rows(40))
                    assert (result.admitted, result.failed) == (40, 6)
                    staged.append(server.requests.get("array_input.put_and_seal", 0) - puts)
                    probed.append(server.requests.get("sheets.probe", 0) - probes)
                sent = {name: server.requests[name] - before.get(name, 0)
                        for name in server.requests}
            if play == "one":
                assert sent["array_input.open_list_map"] == 2
                assert [sent.get(name, 0) for name in opening] == [0, 0, 0]
                assert staged == [1, 1]
                assert probed[0] == 0  # the first map's sheet held no row: nothing to settle
                assert sent.get("array_input.begin", 0) == 0
            else:
                assert [sent[name] for name in opening] == [2, 2, 2]
                assert sent.get("array_input.open_list_map", 0) == 0
                assert server.errors.get("scope_denied", 0) == 0
            scope = PlayScope(tenant.org_id, play)
            assert (await counters_match(tenant, scope, "things"))[0]
        stored = [comparable(await sheets.read_rows(tenant, PlayScope(tenant.org_id, play), "things"))
                  for play in ("one", "three")]
        assert stored[0] == stored[1]


async def test_a_wake_through_the_gateway_replays_the_one_page_list_its_crash_staged(tenant):
    """A run whose incarnation staged its one-page list (begun, put and sealed in one request)
    and died mid-map wakes through the gateway: the map opens in one request, finds the input
    sealed, keeps what was done and runs the rest; a wake with another list is refused."""
    from runplane.engine.errors import ConflictError

    source = rows(60)
    async with serving(tenant) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
            with trio.CancelScope() as crash:
                async def dies_mid_map(row: dict) -> dict:
                    if row["n"] == 30:
                        crash.cancel()  # the process dies here, its run not retired
                        await trio.sleep_forever()
                    return await enrich(row)

                async with open_run(gw, "woken", "run-w", retire_on_exit=False) as run:
                    await run.map("things", source, dies_mid_map, contract=CONTRACT,
                                  concurrency=1)
            assert crash.cancelled_caught
            scope = RunScope(tenant.org_id, "woken", "run-w").map("things", "map-0")
            manifest = await array_input.get_manifest(tenant, scope)
            assert (manifest.state, manifest.source_rows) == ("sealed", 60)
            done_before = (await sheets.summary(tenant, scope.play_scope, "things")).completed
            assert 0 < done_before < 60
            async with open_run(gw, "woken", "run-w", retire_on_exit=False) as run:
                with pytest.raises(ConflictError):
                    await run.map("things", rows(61), enrich, contract=CONTRACT)
            async with open_run(gw, "woken", "run-w") as run:
                before = server.requests["array_input.open_list_map"]
                result = await run.map("things", source, enrich, contract=CONTRACT)
                assert server.requests["array_input.open_list_map"] == before + 1
    assert result.failed == 9 and result.cached + result.completed == 51
    assert result.cached >= done_before  # what the crashed incarnation completed stays
    assert await fact_kinds(tenant, "run-w") == ["array_input_guard"]  # retired at the end
    assert (await counters_match(tenant, scope.play_scope, "things"))[0]


@pytest.mark.parametrize("through", ["direct", "gateway"])
async def test_a_list_map_in_a_retired_run_is_admitted_without_staging(tenant, through):
    """A wake of a run already retired (its staged input gone, nothing to replay it) maps a new
    list by admitting it directly, directly and through the gateway (where the map's one
    opening request answers the retirement)."""
    async with serving(tenant) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
            port = gw if through == "gateway" else tenant
            play, run_id = f"retired-{through}", f"run-{through}"
            async with open_run(port, play, run_id) as run:
                await run.map("things", rows(10), enrich, contract=CONTRACT)
            assert await outbox_state(tenant, run_id) == "done"
            async with open_run(port, play, run_id, retire_on_exit=False) as run:
                result = await run.map("things", rows(20), enrich, contract=CONTRACT)
            opened = server.requests["array_input.open_list_map"]
    assert (result.admitted, result.cached, result.completed, result.failed) == (20, 9, 8, 3)
    assert await fact_kinds(tenant, run_id) == ["array_input_guard"]  # nothing was staged
    assert opened == (2 if through == "gateway" else 0)


async def test_admitted_rows_come_back_by_key_and_the_client_restores_them(tenant):
    """With `runplane-rows: by-key` the server answers pending rows without their inputs (the
    client has them); without it, in full. Either way `admit` through the gateway returns what
    a direct admit does."""
    import httpx

    from runplane.engine.actions import actions

    async with serving(tenant) as server:
        async with open_gateway(server.url, token_for(tenant), retry=FAST_RETRY) as gw:
            run = await runs.register(gw, RunScope(tenant.org_id, "by-key", "r1"))
            through = await sheets.admit(gw, run, "t", CONTRACT, rows(20))
        direct_run = await runs.register(tenant, RunScope(tenant.org_id, "by-key-direct", "r1"))
        direct = await sheets.admit(tenant, direct_run, "t", CONTRACT, rows(20))
        assert [(r.key, r.input_index, r.row) for r in through.pending] == \
            [(r.key, r.input_index, r.row) for r in direct.pending]
        spec = actions()["sheets.admit"]
        second = await runs.register(tenant, RunScope(tenant.org_id, "by-key", "r2"))
        body = protocol.dumps(spec.encode_input({
            "run": second, "table_namespace": "t2", "contract": CONTRACT, "rows": rows(3)}))
        headers = {"authorization": f"Bearer {token_for(tenant)}",
                   "content-type": "application/json"}
        async with httpx.AsyncClient() as client:
            url = f"{server.url}/v1/actions/sheets.admit"
            slim = (await client.post(url, content=body, headers={
                **headers, protocol.ROWS_HEADER: protocol.ROWS_BY_KEY})).json()["result"]
            full = (await client.post(url, content=body, headers=headers)).json()["result"]
        assert [row["row"] for row in slim["pending"]] == [{}, {}, {}]
        assert [row["row"] for row in full["pending"]] == rows(3)


def test_an_outcome_travels_as_the_row_outcome_codec_encodes_it():
    """The completion sender writes each outcome's text from what `prepare_outcomes` made;
    `ROW_OUTCOME` must decode it back to the outcome (error as prepared), for every shape, its
    fields in the codec's order; a plain completed one leaves out the fields the codec
    defaults, every other one spells out all of them."""
    import json

    import attrs

    from runplane.engine.gateway.senders import outcome_texts
    from runplane.engine.sheets.outcome_inputs import prepare_outcomes
    from runplane.engine.sheets.model import ROW_OUTCOME, RowOutcome

    outcomes = [
        RowOutcome("plain", "completed", {"ok": True}, 3),
        RowOutcome("no-data", "completed"),
        RowOutcome("floats", "completed", {"half": 2.0, "x": 0.5, "n": [1.0, "é\u2028"]}, 0, attempts=4),
        RowOutcome("meta", "completed", {"a": 1}, 7, cell_meta={"a": {"src": "x"}}),
        RowOutcome("empty-meta", "completed", {}, None, cell_meta={}),
        RowOutcome("failed", "failed", None, 9, error="boom\nline \"two\" ✓"),
        RowOutcome("blank-error", "failed", None, 10, error="   "),
        RowOutcome("clé \"quoted\"", "completed", {"ok": None}, 11),
        RowOutcome("twice", "completed", {"v": 1}, 12),
        RowOutcome("twice", "failed", None, 12, error="second wins"),
        RowOutcome("caused", "failed", None, 13, error="quota for BGR", cause="quota for <iata>"),
    ]
    prepared, _ = prepare_outcomes(outcomes)
    texts = outcome_texts(outcomes, prepared)
    last = {outcome.key: outcome for outcome in outcomes}
    assert len(texts) == len(prepared) == 10
    plain = {"plain", "clé \"quoted\""}
    for text, one in zip(texts, prepared):
        given = attrs.evolve(last[one.key], error=one.error)
        expected = ROW_OUTCOME.encode(given, "o")
        sent = json.loads(text)
        assert ROW_OUTCOME.decode(sent, "o") == given
        if one.key in plain:
            assert list(sent) == ["key", "status", "data", "input_index"]
            assert sent == {name: expected[name] for name in sent}
        else:
            assert sent == expected
        assert list(sent) == [name for name in expected if name in sent]  # the codec's order


def test_plain_outcomes_travel_a_field_at_a_time_as_one_at_a_time():
    """A completion of plain completed outcomes, no key twice, is written a field at a time;
    each text is the one the outcome alone gets (one with any other shape among them: the
    whole list goes one at a time)."""
    import json

    from runplane.engine.gateway.senders import outcome_texts
    from runplane.engine.sheets.outcome_inputs import completed_outcome, prepare_outcomes
    from runplane.engine.sheets.model import ROW_OUTCOME, RowOutcome

    plain = [completed_outcome(f"k{i} \"é\"", {"ok": i, "s": "\u2028"}, i, 1) for i in range(4)]
    plain.append(RowOutcome("built", "completed", {"ok": True}, 9))
    alone = [outcome_texts([one], prepare_outcomes([one])[0])[0] for one in plain]
    assert outcome_texts(plain, prepare_outcomes(plain)[0]) == alone
    for text, one in zip(alone, plain):
        assert ROW_OUTCOME.decode(json.loads(text), "o") == one
        assert list(json.loads(text)) == ["key", "status", "data", "input_index"]
    for odd in (RowOutcome("odd", "completed", None, 5), RowOutcome("odd", "completed", {}, None),
                RowOutcome("odd", "completed", {}, 5, attempts=2),
                RowOutcome("odd", "completed", {}, 5, cell_meta={}),
                RowOutcome("odd", "failed", None, 5, error="boom")):
        mixed = [*plain, odd]
        texts = outcome_texts(mixed, prepare_outcomes(mixed)[0])
        assert texts[:-1] == alone
        assert ROW_OUTCOME.decode(json.loads(texts[-1]), "o") == odd
        assert len(json.loads(texts[-1])) == 8  # every field spelled out


def test_the_gateway_decodes_plain_completed_outcomes_as_the_codec_does():
    """The gateway's short way for a completion of plain completed outcomes
    (`bodies.completed_outcomes`) prepares them as `prepare_outcomes` prepares the codec's
    outcomes, whether their null fields are spelled out or left out; a list with any other
    outcome is left to the codec, whose error names the outcome."""
    import json

    from runplane.engine.actions import _REGISTRY
    from runplane.engine.gateway.bodies import completed_outcomes, decode_body
    from runplane.engine.sheets.outcome_inputs import prepare_outcomes
    from runplane.engine.sheets.model import ROW_OUTCOME, RowOutcome
    from runplane.engine.values.codecs import list_of

    plain = [RowOutcome("a", "completed", {"ok": True, "half": 2.0, "s": "é", "n": [1.0]}, 3,
                        attempts=2),
             RowOutcome("b", "completed", {}, None)]
    wire = json.loads(json.dumps([ROW_OUTCOME.encode(outcome, "o") for outcome in plain]))
    fast, slow = completed_outcomes(wire), list_of(ROW_OUTCOME).decode(wire, "outcomes")
    assert prepare_outcomes(fast) == prepare_outcomes(slow)
    assert fast[0].data_text == '{"ok":true,"half":2,"s":"é","n":[1]}'  # normalized
    compact = [{name: value for name, value in item.items() if value is not None}
               for item in wire]
    assert prepare_outcomes(completed_outcomes(compact)) == prepare_outcomes(slow)

    failed = ROW_OUTCOME.encode(RowOutcome("c", "failed", None, 1, error="no"), "o")
    for other in ([*wire, failed], [{**wire[0], "cell_meta": {"ok": {"src": "x"}}}],
                  [{**wire[0], "extra": 1}], [{**wire[0], "input_index": True}],
                  [{**wire[0], "data": None}], [{**wire[0], "key": ""}], {"not": "a list"}):
        assert completed_outcomes(other) is None

    spec = _REGISTRY["sheets.complete"]
    body = {"run": {"scope": {"org_id": "o", "play": "p", "run_id": "r"}, "epoch": 1},
            "table_namespace": "t", "contract": {"inputs": ["x"], "outputs": ["ok"]},
            "outcomes": wire}
    kwargs, _ = decode_body(spec, json.dumps(body).encode())
    assert prepare_outcomes(kwargs["outcomes"]) == prepare_outcomes(slow)
    body["outcomes"] = [wire[0], {**wire[1], "input_index": -1}]
    with pytest.raises(InvalidInputError) as by_codec:
        list_of(ROW_OUTCOME).decode(body["outcomes"], "outcomes")
    with pytest.raises(InvalidInputError, match="RowOutcome 'b': input_index") as by_gateway:
        decode_body(spec, json.dumps(body).encode())
    assert str(by_gateway.value) == str(by_codec.value)
