"""Every interleaving of the core races' statements (isolation-tester style), each outcome checked
against what the fences allow (docs/architecture.md).

Each race is two sessions on their own connections; each session's statements are gated and
granted one at a time in every possible order (`simulations.interleavings`). A statement that
waits on a lock lets the other session proceed. Every race plays exactly C(a+b, a) orders.
"""

from __future__ import annotations

import math

import pytest
import trio

from runplane.engine import RunScope, array_input as A, receipts, sheets
from runplane.engine.errors import RetiredError
from runplane.engine.sheets import RowOutcome, SheetContract
from runplane.engine.sheets.layout import layout_for
from runplane.simulations.counters import counters_match
from runplane.simulations.interleavings import Session, interleavings, open_interleaver

from tests.array_input_support import facts, occurrences
from tests.sheet_helpers import new_run, play_scope, raw_rows

PLAY = "play"
TIMEOUT_S = 120


def test_interleavings_are_every_multiset_permutation():
    orders = list(interleavings({"A": 2, "B": 3}))
    assert len(orders) == len(set(orders)) == math.comb(5, 2)
    assert all(order.count("A") == 2 and order.count("B") == 3 for order in orders)
    assert len(list(interleavings({"A": 4, "B": 4}))) == 70


async def test_a_step_waiting_on_a_lock_lets_the_other_session_proceed(tenant, dsn):
    t = f'"{tenant.schema}".lock_probe'
    async with tenant.connection("receipts") as conn:
        await conn.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
        await conn.execute(f"INSERT INTO {t} VALUES (1, 'start')")

    async def holder(port):  # UPDATE, COMMIT: holds the row lock between its two steps
        async with port.connection("receipts") as conn:
            async with conn.transaction():
                await conn.execute(f"UPDATE {t} SET v = v || ',A' WHERE id = 1")

    async def waiter(port):  # UPDATE (waits for the holder's commit), then SELECT
        async with port.connection("receipts") as conn:
            await conn.execute(f"UPDATE {t} SET v = v || ',B' WHERE id = 1")
            return await conn.fetchval(f"SELECT v FROM {t} WHERE id = 1")

    sessions = [Session("A", holder), Session("B", waiter)]
    with trio.fail_after(TIMEOUT_S):
        async with open_interleaver(tenant, dsn) as interleaver:
            played = await interleaver.play(sessions, ("A", "B", "B", "A"))
    # B's UPDATE blocked behind A's row lock, so B's SELECT could not go next: A's COMMIT ran
    # instead, which let B's UPDATE finish and its SELECT run.
    assert played.reordered and played.errors == {"A": None, "B": None}
    assert [name for name, _ in played.granted] == ["A", "B", "A", "B"]
    assert played.results["B"] == "start,A,B"


async def enumerate_race(tenant, dsn, name, make_sessions, check) -> tuple[int, int]:
    """Play every interleaving of the sessions `make_sessions(i)` builds for interleaving i
    (fresh state each time); `check(i, played)` judges each. Returns (played, reordered)."""
    played_count = reordered = 0
    with trio.fail_after(TIMEOUT_S):
        async with open_interleaver(tenant, dsn) as interleaver:
            counts = await interleaver.step_counts(await make_sessions(-1))
            assert all(2 <= n <= 4 for n in counts.values()), counts
            for i, schedule in enumerate(interleavings(counts)):
                played = await interleaver.play(await make_sessions(i), schedule)
                await check(i, played)
                played_count += 1
                reordered += played.reordered
    expected = math.comb(sum(counts.values()), next(iter(counts.values())))
    print(f"{name}: {played_count} interleavings of {counts} ({reordered} reordered by a lock wait)")
    assert played_count == expected
    return played_count, reordered


# -- two claims of one receipt ---------------------------------------------------------------
def claim_model(order: list[tuple[str, int, str]]):
    """The spec's claim/complete rules applied in `order` ((session, epoch, op)): each session's
    disposition and completion result, and the receipt stored at the end."""
    stored = None  # (status, epoch, output)
    seen: dict[str, dict] = {}
    for session, epoch, op in order:
        if op == "claim":
            if stored is None:
                disposition, stored = "claimed", ("running", epoch, None)
            elif stored[0] == "completed":
                disposition = "reused"
            elif stored[1] > epoch:
                disposition = "fenced"
            elif stored[0] == "running":
                disposition = "running"
            else:
                disposition, stored = "claimed", ("running", epoch, None)
            seen.setdefault(session, {})["claim"] = disposition
        else:
            if stored is None or stored[1] <= epoch:
                stored = ("completed", epoch, {"by": session})
            seen.setdefault(session, {})["complete"] = stored
    return seen, stored


async def test_two_claims_of_one_receipt(tenant, dsn):
    older, newer = await new_run(tenant, PLAY, "run-old"), await new_run(tenant, PLAY, "run-new")
    assert older.epoch < newer.epoch

    def claimer(run, key, name):
        async def program(port):
            claim = await receipts.claim(port, run, key)
            done = await receipts.complete(port, run, key, {"by": name})
            return claim.disposition, done

        return Session(name, program)

    async def sessions(i):
        key = f"k{i}"
        return [claimer(older, key, "A"), claimer(newer, key, "B")]

    async def check(i, played):
        assert played.errors == {"A": None, "B": None}, played
        epochs = {"A": older.epoch, "B": newer.epoch}
        ops, taken = [], {"A": 0, "B": 0}
        for session, _sql in played.granted:
            ops.append((session, epochs[session], ("claim", "complete")[taken[session]]))
            taken[session] += 1
        seen, stored = claim_model(ops)
        for session in ("A", "B"):
            disposition, done = played.results[session]
            want = seen[session]["complete"]
            assert disposition == seen[session]["claim"], (played.schedule, session)
            assert (done.status, done.epoch, done.output) == want, (played.schedule, session)
        final = await receipts.get(tenant, play_scope(tenant), f"k{i}")
        assert (final.status, final.epoch, final.output) == stored
        # The newer run's completion always holds; at most one session claimed while the
        # receipt was not the other's.
        assert stored == ("completed", newer.epoch, {"by": "B"})
        outcomes.add((played.results["A"][0], played.results["B"][0]))

    outcomes: set = set()
    await enumerate_race(tenant, dsn, "two claims of one receipt", sessions, check)
    # Not vacuous: each session both won the claim and met the other's receipt somewhere.
    assert {a for a, _ in outcomes} >= {"claimed", "fenced", "reused"}
    assert {b for _, b in outcomes} >= {"claimed", "running", "reused"}


# -- a completion vs a newer run's admission of the same rows --------------------------------
CONTRACT = SheetContract(inputs=("name",), outputs=("score",))


async def test_completion_vs_a_newer_runs_admission(tenant, dsn):
    older, newer = await new_run(tenant, PLAY, "run-old"), await new_run(tenant, PLAY, "run-new")
    await sheets.ensure_sheet(tenant, play_scope(tenant), "race", CONTRACT)

    async def sessions(i):
        rows = [{"name": f"a{i}"}, {"name": f"b{i}"}]
        admitted = await sheets.admit(tenant, older, "race", CONTRACT, rows)
        keys = [row.key for row in admitted.pending]
        assert len(keys) == 2

        async def complete(port):
            return await sheets.complete(port, older, "race", CONTRACT, [
                RowOutcome(key, "completed", {"score": n}) for n, key in enumerate(keys)])

        async def admit(port):
            return await sheets.admit(port, newer, "race", CONTRACT, rows)

        return [Session("complete", complete), Session("admit", admit)]

    async def check(i, played):
        assert played.errors == {"complete": None, "admit": None}, played
        completion, admission = played.results["complete"], played.results["admit"]
        stored = await raw_rows(tenant, play_scope(tenant), "race", ("score",))
        fenced = {row.key for row in completion.fenced}
        cached = {row.key for row in admission.completed}
        taken = {row.key for row in admission.pending}
        keys = set(completion.committed_keys) | fenced
        assert len(keys) == 2
        for key in keys:
            row = stored[key]
            if key in completion.committed_keys:
                # The old run finished the row first: the newer run finds it cached.
                assert key in cached and key not in taken, played.schedule
                assert (row["_status"], row["_run_id"]) == ("enriched", "run-old")
            else:
                # The newer run took the row over first: the old run's write is fenced.
                assert key in fenced and key in taken and key not in cached, played.schedule
                assert row["_status"] != "enriched" and row["_run_id"] == "run-new"
        ok, detail = await counters_match(tenant, play_scope(tenant), "race")
        assert ok, detail
        outcomes.add(len(completion.committed_keys))

    outcomes: set = set()
    _, reordered = await enumerate_race(tenant, dsn, "completion vs newer admission", sessions,
                                        check)
    assert outcomes == {0, 2} and reordered > 0  # both orders happen; row locks were waited on


# -- seal vs retire, put_page vs retire ------------------------------------------------------
SOURCE = occurrences(1500)  # two pages
FINGERPRINT = A.source_fingerprint(SOURCE)
DRAFTS = A.paginate(SOURCE)


async def begin(tenant, i, *, pages: int):
    run = RunScope(tenant.org_id, PLAY, f"run-{i}")
    scope = run.map("companies", "map-1")
    await A.begin(tenant, scope, source_fingerprint=FINGERPRINT, source_rows=len(SOURCE),
                  has_source_identities=False)
    for draft in DRAFTS[:pages]:
        await A.put_page(tenant, scope, source_fingerprint=FINGERPRINT, ordinal=draft.ordinal,
                         offset=draft.offset, rows=draft.rows)
    return run, scope


def retirer(run):
    async def program(port):
        results = [await A.retire(port, run)]
        while not results[-1].done:
            results.append(await A.retire(port, run))
        return results

    return Session("retire", program)


async def only_the_retired_guard_is_left(tenant, run):
    assert [kind for kind, _ in await facts(tenant, run.run_id)] == ["array_input_guard"]
    with pytest.raises(RetiredError):
        await A.get_manifest(tenant, run.map("companies", "map-1"))


async def test_seal_vs_retire(tenant, dsn):
    runs: dict[int, RunScope] = {}

    async def sessions(i):
        run, scope = await begin(tenant, i, pages=len(DRAFTS))
        runs[i] = run

        async def seal(port):
            return await A.seal(port, scope, source_fingerprint=FINGERPRINT,
                                source_rows=len(SOURCE), page_count=len(DRAFTS), batch_size=4)

        return [Session("seal", seal), retirer(run)]

    async def check(i, played):
        assert played.errors["retire"] is None and played.results["retire"][-1].done
        sealed_before = max(n for n, (s, _) in enumerate(played.granted) if s == "seal") \
            < played.first_grant("retire")
        error = played.errors["seal"]
        if sealed_before:
            assert error is None, (played.schedule, error)  # sealed, then retired with the rest
        else:
            assert isinstance(error, RetiredError), (played.schedule, error)
        await only_the_retired_guard_is_left(tenant, runs[i])
        outcomes.add(error is None)

    outcomes: set = set()
    await enumerate_race(tenant, dsn, "seal vs retire", sessions, check)
    assert outcomes == {True, False}


async def test_put_page_vs_retire(tenant, dsn):
    runs: dict[int, RunScope] = {}

    async def sessions(i):
        run, scope = await begin(tenant, i, pages=0)
        runs[i] = run

        async def put(port):
            outcomes = []
            for draft in DRAFTS:
                try:
                    await A.put_page(port, scope, source_fingerprint=FINGERPRINT,
                                     ordinal=draft.ordinal, offset=draft.offset, rows=draft.rows)
                    outcomes.append("ok")
                except RetiredError:
                    outcomes.append("retired")
            return outcomes

        return [Session("put", put), retirer(run)]

    async def check(i, played):
        assert played.errors == {"put": None, "retire": None}, played
        retired_at = played.first_grant("retire")
        puts = [n for n, (s, _) in enumerate(played.granted) if s == "put"]
        expected = ["ok" if n < retired_at else "retired" for n in puts]
        assert played.results["put"] == expected, played.schedule
        await only_the_retired_guard_is_left(tenant, runs[i])
        outcomes.add(tuple(played.results["put"]))

    outcomes: set = set()
    await enumerate_race(tenant, dsn, "put_page vs retire", sessions, check)
    assert outcomes == {("ok", "ok"), ("ok", "retired"), ("retired", "retired")}


# -- two column extensions -------------------------------------------------------------------
def extension_step(sql: str) -> bool:
    """The statements where two extensions can interleave: the first (failing) attempt, the
    sheet's exclusive lock (its summary row, claimed), the ALTER, and the COMMIT."""
    text = sql.lstrip()
    summary_lock = text.startswith("INSERT INTO") and "sheet_summary" in text.split("(", 1)[0]
    return summary_lock or text.startswith(("WITH claimed", "ALTER TABLE", "COMMIT"))


async def test_two_column_extensions(tenant, dsn):
    run = await new_run(tenant, PLAY, "run-1")

    async def sessions(i):
        namespace = f"ext{i + 1}"
        await sheets.ensure_sheet(tenant, play_scope(tenant), namespace, CONTRACT)
        admitted = await sheets.admit(tenant, run, namespace, CONTRACT,
                                      [{"name": "a"}, {"name": "b"}])
        keys = {row.row["name"]: row.key for row in admitted.pending}

        def extender(name, field):
            contract = SheetContract(inputs=("name",), outputs=("score", field))

            async def program(port):
                return await sheets.complete(port, run, namespace, contract, [
                    RowOutcome(keys[name], "completed", {"score": 1, field: name})])

            return Session(field, program, extension_step)

        return [extender("a", "extra_a"), extender("b", "extra_b")]

    async def check(i, played):
        assert played.errors == {"extra_a": None, "extra_b": None}, played
        namespace = f"ext{i + 1}"
        scope = play_scope(tenant)
        for field in ("extra_a", "extra_b"):
            assert len(played.results[field].committed_keys) == 1, (played.schedule, field)
        stored = await raw_rows(tenant, scope, namespace, ("extra_a", "extra_b"))
        values = {(row["_status"], row["extra_a"], row["extra_b"]) for row in stored.values()}
        assert values == {("enriched", "a", None), ("enriched", None, "b")}, played.schedule
        summary = await sheets.summary(tenant, scope, namespace)
        assert (summary.columns["extra_a"].completed, summary.columns["extra_b"].completed) == (1, 1)
        ok, detail = await counters_match(tenant, scope, namespace)
        assert ok, detail
        assert layout_for(tenant, scope, namespace) is not None

    _, reordered = await enumerate_race(tenant, dsn, "two column extensions", sessions, check)
    assert reordered > 0  # the sheet's exclusive lock was waited on, and the other proceeded
