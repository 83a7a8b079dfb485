"""The outage budget: how `retry_transient` waits through a store outage inside a run, when it
gives up, and how the budget is configured and validated."""

from __future__ import annotations

import pytest
import trio

from runplane.actors import open_run
from runplane.actors.retry import (
    BACKOFF_CAP_S, RETRY_DELAYS, OutageWatch, backoff_s, current_watch, retry_transient,
)
from runplane.actors.progress import MapTally
from runplane.engine import open_tenant
from runplane.engine.errors import (
    ConflictError, GatewayUnavailableError, InvalidInputError, StoreOutageError,
    StoreUnavailableError, TenantUnavailableError, TenantUnreachableError,
)
from runplane.engine.opening import outage_budget
from runplane.engine.tenant import DEFAULT_OUTAGE_BUDGET_S, OUTAGE_BUDGET_ENV


class Flaky:
    """Fails transiently `failures` times (recording when), then answers."""

    def __init__(self, failures: int, error: type[Exception] = StoreUnavailableError) -> None:
        self.failures = failures
        self.error = error
        self.calls: list[float] = []

    async def __call__(self) -> str:
        self.calls.append(trio.current_time())
        if len(self.calls) <= self.failures:
            raise self.error("injected: connection refused")
        return "ok"


async def test_a_call_inside_the_budget_waits_and_resumes(autojump_clock, caplog):
    watch = OutageWatch(budget_s=60)
    op = Flaky(failures=30)
    with caplog.at_level("WARNING", logger="runplane.actors"):
        assert await retry_transient(op, watch=watch) == "ok"
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages  # one when the wait began, one when it ended
    assert messages[0].startswith("waiting for the database (outage budget 60s): injected")
    assert messages[1].startswith("the database is back after ")
    gaps = [b - a for a, b in zip(op.calls, op.calls[1:])]
    assert all(gap <= BACKOFF_CAP_S + 1e-9 for gap in gaps)  # capped
    assert gaps[-1] >= BACKOFF_CAP_S / 2                      # and grown to the cap
    assert watch.outages == 1 and watch.waiting == 0 and watch.waiting_s() is None
    assert op.calls[-1] - op.calls[0] < 60


async def test_a_call_past_the_budget_raises_store_outage_error(autojump_clock):
    watch = OutageWatch(budget_s=10)
    op = Flaky(failures=10_000, error=TenantUnreachableError)
    with pytest.raises(StoreOutageError, match="outage budget of 10s") as caught:
        await retry_transient(op, watch=watch)
    assert isinstance(caught.value, StoreUnavailableError)
    assert isinstance(caught.value.__cause__, TenantUnreachableError)
    assert caught.value.waited_s >= 10 and caught.value.budget_s == 10
    assert op.calls[-1] - op.calls[0] <= 10 + 1e-9  # never waits past the budget
    assert watch.exhausted and watch.outages == 0
    # The run is ending: a later call under the same watch tries once, without waiting.
    again = Flaky(failures=1)
    with pytest.raises(StoreOutageError, match="budget of 10s is spent"):
        await retry_transient(again, watch=watch)
    assert len(again.calls) == 1


async def test_the_watch_says_how_long_the_run_has_been_waiting(autojump_clock):
    watch = OutageWatch(budget_s=60)
    op = Flaky(failures=10)
    seen: list[float | None] = []

    async def observe() -> None:
        for _ in range(30):  # past the retries' end (at most 10 waits of at most 2 s)
            await trio.sleep(1.0)
            seen.append(watch.waiting_s())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(observe)
        assert await retry_transient(op, watch=watch) == "ok"
    assert seen[0] is not None and seen[0] > 0
    assert seen[-1] is None  # back


async def test_errors_that_are_not_transient_are_raised_at_once(autojump_clock):
    watch = OutageWatch(budget_s=60)
    for error in (ConflictError, GatewayUnavailableError, StoreOutageError,
                  TenantUnavailableError):
        op = Flaky(failures=1, error=error)
        with pytest.raises(error):
            await retry_transient(op, watch=watch)
        assert len(op.calls) == 1
    assert watch.waiting == 0


async def test_outside_a_run_the_short_ladder_applies(autojump_clock):
    assert current_watch() is None
    op = Flaky(failures=100)
    with pytest.raises(StoreUnavailableError):
        await retry_transient(op)
    assert len(op.calls) == len(RETRY_DELAYS) + 1


def test_backoff_doubles_to_the_cap_with_jitter():
    import random

    rng = random.Random(7)
    for attempt in range(1, 12):
        delay = backoff_s(attempt, rng)
        ceiling = min(BACKOFF_CAP_S, 0.05 * 2 ** (attempt - 1))
        assert ceiling / 2 <= delay <= ceiling


def test_a_transient_connect_failure_is_both_tenant_and_store_unavailable():
    error = TenantUnreachableError("cannot connect to host: refused")
    assert isinstance(error, TenantUnavailableError) and isinstance(error, StoreUnavailableError)
    assert not issubclass(TenantUnavailableError, StoreUnavailableError)  # e.g. a bad password
    assert issubclass(StoreOutageError, StoreUnavailableError)


def test_the_budget_comes_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv(OUTAGE_BUDGET_ENV, raising=False)
    assert outage_budget() == DEFAULT_OUTAGE_BUDGET_S == 60
    monkeypatch.setenv(OUTAGE_BUDGET_ENV, "7.5")
    assert outage_budget() == 7.5
    assert outage_budget(3) == 3.0
    for bad in (-1, float("nan"), float("inf"), "10", True):
        with pytest.raises(InvalidInputError, match="outage_budget_s"):
            outage_budget(bad)
    monkeypatch.setenv(OUTAGE_BUDGET_ENV, "soon")
    with pytest.raises(InvalidInputError, match=OUTAGE_BUDGET_ENV):
        outage_budget()


async def test_open_tenant_refuses_a_bad_budget_before_connecting():
    with pytest.raises(InvalidInputError, match="outage_budget_s"):
        async with open_tenant("org-test", "postgresql://nobody@127.0.0.1:1/none",
                               outage_budget_s=-5):
            pass


async def test_opening_a_tenant_on_a_database_that_is_down_fails_fast():
    with trio.fail_after(30):
        with pytest.raises(TenantUnavailableError, match="cannot connect to 127.0.0.1:1") as caught:
            async with open_tenant("org-test", "postgresql://nobody@127.0.0.1:1/none"):
                pass
    assert isinstance(caught.value, TenantUnreachableError)


async def test_a_run_gets_the_tenants_budget_and_its_tasks_see_the_watch(dsn):
    async with open_tenant("org-test", dsn, schema="outage_budget_probe",
                           outage_budget_s=12) as tenant:
        async with open_run(tenant, "budget") as run:
            assert run.outage.budget_s == 12 and current_watch() is run.outage
            seen = []

            async def child() -> None:
                seen.append(current_watch())

            run.start_soon(child)
        assert seen == [run.outage]
        assert current_watch() is None
        tally = MapTally()
        assert tally.snapshot().waiting_for_store_s is None
        async with tenant.connection("sheet") as conn:
            await conn.execute('DROP SCHEMA IF EXISTS "outage_budget_probe" CASCADE')

