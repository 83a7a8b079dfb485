"""A database session's map overlaps its own sheet writes as an owner's does
(`engine.sheets.write_group`): the session adds counter deltas (INSERT under row-level
security) and folds them by zeroing (no DELETE, `engine.sheets.counters`), and a session role
minted before sessions could writes the ordinary way."""

from __future__ import annotations

import contextlib

import pytest
import trio

from runplane.engine.errors import InsufficientPrivilegeError
from runplane.engine.sessions.grants import SHARED_MAP_COLUMNS
from runplane.engine.shared import maps as shared_maps
from runplane.engine.sheets import admit, complete, ensure_sheet, summary, write_group
from runplane.engine.sheets.layout import layout_for
from runplane.engine.sheets.sheet_write import SheetWrite
from runplane.engine.sheets.write_group import GroupTxn, Turn
from runplane.engine.sql import qualified, quote_ident
from runplane.engine import sessions
from runplane.engine.values.scopes import PlayScope
from runplane.simulations.ports import GatedPort
from tests.session_helpers import CONTRACT, NAMESPACE, admin_tenant, session_tenant, unique
from tests.sheet_helpers import completions, counters_match, is_commit, named_rows, new_run

PLAY = "play"


async def delta_rows(admin) -> list[tuple]:
    """The sheet's counter delta rows, as the owner sees them: (slot, total, completed)."""
    layout = layout_for(admin, PlayScope(admin.org_id, PLAY), NAMESPACE)
    async with admin.login_connection() as conn:
        found = await conn.fetch(
            f"SELECT slot, total, completed FROM {qualified(admin.schema, 'sheet_counter_deltas')}"
            " WHERE org_id = $1 AND play = $2 AND table_namespace = $3 ORDER BY slot",
            *layout.counter_args)
    return [tuple(r) for r in found]


@contextlib.asynccontextmanager
async def an_upserting_session(dsn):
    """An org with a sheet and a run, and a session minted to upsert its rows."""
    async with admin_tenant(dsn, unique("org")) as admin:
        scope = PlayScope(admin.org_id, PLAY)
        await ensure_sheet(admin, scope, NAMESPACE, CONTRACT)
        run = await new_run(admin, PLAY, "r1")
        yield admin, scope, run, await sessions.mint(admin, scope, NAMESPACE, ["rows.upsert"])


async def test_a_sessions_map_overlaps_its_own_writes_and_folds_by_zeroing(dsn):
    async with an_upserting_session(dsn) as (admin, scope, run, minted):
        async with session_tenant(dsn, minted, max_connections=3) as session:
            port = GatedPort(session)
            # alone: the ordinary way
            first = await admit(port, run, NAMESPACE, CONTRACT, named_rows("a", 50))
            layout = layout_for(port, scope, NAMESPACE)
            group = write_group.group_of(port, (layout.counter_args, run.run_id, run.epoch))
            assert group.token is not None
            ordinary_commit = port.gate(is_commit)
            held_commit = port.gate(
                lambda b: is_commit(b) and b.checkout != ordinary_commit.boundary.checkout)
            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(complete, port, run, NAMESPACE, CONTRACT, completions(first))
                    await ordinary_commit.wait_reached()
                    nursery.start_soon(admit, port, run, NAMESPACE, CONTRACT, named_rows("b", 40))
                    while not group.waiting:
                        await trio.sleep(0.01)
                    ordinary_commit.release()
                    await held_commit.wait_reached()  # holds the summary row FOR SHARE ...
                    # ... beside it
                    await admit(port, run, NAMESPACE, CONTRACT, named_rows("c", 30))
                    held_commit.release()
            assert group.overlapped == 2
            added = await delta_rows(admin)
            assert added and sum(total for _, total, _ in added) == 70  # the session's deltas
            # Its next ordinary transaction folds them, zeroing its rows in place.
            await admit(port, run, NAMESPACE, CONTRACT, named_rows("d", 5))
        assert group.overlapped == 2 and group.since_ordinary == 0
        zeroed = await delta_rows(admin)
        assert zeroed and all(total == 0 and completed == 0 for _, total, completed in zeroed)
        assert (await counters_match(admin, scope, NAMESPACE))[0]
        counts = await summary(admin, scope, NAMESPACE)
        assert (counts.total, counts.completed, counts.queued) == (125, 50, 75)
        # An owner's ordinary writer deletes the zeroed rows with the rest.
        other = await new_run(admin, PLAY, "r2")
        await admit(admin, other, NAMESPACE, CONTRACT, named_rows("e", 5))
        assert await delta_rows(admin) == []
        assert (await counters_match(admin, scope, NAMESPACE))[0]


async def test_a_session_minted_before_sessions_wrote_deltas_writes_the_ordinary_way(dsn):
    async with an_upserting_session(dsn) as (admin, scope, run, minted):
        role = quote_ident(minted.role)
        async with admin.login_connection() as conn:  # the grants of an older session role
            for name in ("sheet_counter_deltas", "sheet_column_deltas"):
                await conn.execute(f"REVOKE INSERT ON {qualified(admin.schema, name)} FROM {role}")
                columns = await conn.fetchval(
                    "SELECT array_agg(attname::text) FROM pg_attribute WHERE attrelid = $1::regclass"
                    " AND attnum > 0 AND NOT attisdropped", f"{admin.schema}.{name}")
                await conn.execute(
                    f"REVOKE INSERT ({', '.join(map(quote_ident, columns))})"
                    f" ON {qualified(admin.schema, name)} FROM {role}")
            await conn.execute(f"REVOKE SELECT ({SHARED_MAP_COLUMNS})"
                               f" ON {qualified(admin.schema, 'shared_maps')} FROM {role}")
        async with session_tenant(dsn, minted) as session:
            port = GatedPort(session)
            await admit(port, run, NAMESPACE, CONTRACT, named_rows("a", 10))
            layout = layout_for(port, scope, NAMESPACE)
            group = write_group.group_of(port, (layout.counter_args, run.run_id, run.epoch))
            group.in_flight.append(GroupTxn(frozenset(), Turn.GROUP, group.token))  # its turn
            admission = await admit(port, run, NAMESPACE, CONTRACT, named_rows("b", 10))
            assert len(admission.pending) == 10 and group.overlapped == 0
            plain = SheetWrite(run, NAMESPACE, CONTRACT)
            assert write_group.group_for(port, layout.counter_args, plain, guarded=False) is None
        assert (await counters_match(admin, scope, NAMESPACE))[0]
        assert (await summary(admin, scope, NAMESPACE)).total == 20


async def test_a_session_adds_deltas_and_reads_shared_maps_of_its_own_sheet_only(dsn):
    async with admin_tenant(dsn, unique("victim")) as victim:
        victim_scope = PlayScope(victim.org_id, PLAY)
        await ensure_sheet(victim, victim_scope, NAMESPACE, CONTRACT)
        victim_run = await new_run(victim, PLAY, "r1")
        await shared_maps.publish(victim, victim_run, "map-0", NAMESPACE, config={}, function="f",
                                  play_digest="d", units=[(0, 0, 1)])
        async with admin_tenant(dsn, unique("attacker"), schema=victim.schema) as attacker:
            scope = PlayScope(attacker.org_id, PLAY)
            await ensure_sheet(attacker, scope, NAMESPACE, CONTRACT)
            own_run = await new_run(attacker, PLAY, "r1")
            await shared_maps.publish(attacker, own_run, "map-0", NAMESPACE, config={},
                                      function="f", play_digest="d", units=[(0, 0, 1)])
            minted = await sessions.mint(attacker, scope, NAMESPACE, ["rows.upsert"])
            deltas = qualified(victim.schema, "sheet_counter_deltas")
            column_deltas = qualified(victim.schema, "sheet_column_deltas")
            async with session_tenant(dsn, minted) as session:
                async with session.login_connection() as conn:
                    # Its own sheet's delta rows: yes (as a write group adds them).
                    await conn.execute(
                        f"INSERT INTO {deltas} (org_id, play, table_namespace, slot, total)"
                        " VALUES ($1, $2, $3, 1, 0)", attacker.org_id, PLAY, NAMESPACE)
                    for org, play in ((victim.org_id, PLAY), (attacker.org_id, "other-play")):
                        with pytest.raises(InsufficientPrivilegeError):
                            await conn.execute(
                                f"INSERT INTO {deltas} (org_id, play, table_namespace, slot, total)"
                                " VALUES ($1, $2, $3, 2, 1)", org, play, NAMESPACE)
                        with pytest.raises(InsufficientPrivilegeError):
                            await conn.execute(
                                f"INSERT INTO {column_deltas} (org_id, play, table_namespace, field,"
                                " slot, completed) VALUES ($1, $2, $3, 'score', 2, 1)",
                                org, play, NAMESPACE)
                    seen = await conn.fetch(
                        f"SELECT org_id, state FROM {qualified(victim.schema, 'shared_maps')}")
                    assert [r["org_id"] for r in seen] == [attacker.org_id]
                    with pytest.raises(InsufficientPrivilegeError):  # only the columns it needs
                        await conn.fetch(
                            f"SELECT config FROM {qualified(victim.schema, 'shared_maps')}")
            async with victim.login_connection() as conn:
                assert await conn.fetchval(
                    f"SELECT count(*) FROM {deltas} WHERE org_id = $1", victim.org_id) == 0
