"""Retrying a table: its failed rows, or a chosen set recomputed, run again by the play's workers.

How it works
- `prepare_retry(port, play, table, selection)` checks the retry before anything is written and
  reads what the table's last recorded map ran (`engine.runs.retry_spec`, through the action of
  its token claim: `maps.retry_failed`, or `maps.force` when it recomputes).
- `retry_table(run, plan)` reads the rows to run, each with its stored key and stored inputs
  (`engine.sheets.dataset`: the rows of one status, failed by default, or every row; only
  those one run wrote when asked), and maps them as a shared map of `run` (`Run.map(...,
  shared=True)`) with the recorded contract and row policies and a `PublishedFunction` of the
  recorded function. Each staged row carries its stored `_key`, under which the workers admit
  it; the function gets the stored inputs. The play file's digest is not checked: a retry
  usually follows a fix of the function. The coordinator runs no rows (`runplane worker
  PLAY.py` does); the run and its map are in the history like any other.
- Without `force` admission re-runs the failed rows and leaves finished ones (a row that
  finished meanwhile is a cache hit); with `force` every selected row is computed again.
- Nothing to run (no row matches) gives an empty result without publishing anything.
- `RetryHost` hosts the coordinators of the retries a console starts (`runplane console`): each
  in a task of the console's nursery, with a tenant of its own, answering the new run's id
  once it is registered; a refused order raises to the console before anything is written.
Refused before anything is written (`InvalidInputError`): an unknown status, finished rows
without `force`, a table no map recorded a function for (a lambda or a nested function: run the
play again instead).
"""

from __future__ import annotations

import logging
from typing import Callable

import attrs
import trio

from runplane.engine.canonical import JsonObject
from runplane.engine.console.actions import RetryOrder
from runplane.engine.errors import InvalidInputError
from runplane.engine.opening import open_tenant
from runplane.engine.ports import Port
from runplane.engine.runs.retry_spec import RetrySpec, retry_spec
from runplane.engine.sheets.dataset import dataset
from runplane.engine.sheets.model import RowStatus
from runplane.engine.values.scopes import PlayScope, normalize_namespace

from .map_options import MapOptions
from .progress import MapProgress, MapResult
from .run import Run, open_run
from .shared.config import FunctionIdentity, PublishedFunction, decode_config


log = logging.getLogger("runplane.actors")

PAGE_ROWS = 5000  # rows read per page of the table


@attrs.frozen
class RetrySelection:
    """Which rows a retry runs: those of `status` (None: every row), only those `run_id` wrote
    when given; `force` computes finished rows again."""

    status: str | None = RowStatus.FAILED.value
    run_id: str | None = None
    force: bool = False

    def __attrs_post_init__(self) -> None:
        statuses = tuple(s.value for s in RowStatus)
        if self.status is not None and self.status not in statuses:
            raise InvalidInputError(f"status must be one of {', '.join(statuses)} or None (every "
                                    f"row), got {self.status!r}")
        if not isinstance(self.force, bool):
            raise InvalidInputError(f"force must be True or False, got {self.force!r}")
        if not self.force and self.status != RowStatus.FAILED.value:
            raise InvalidInputError("only failed rows run again without force; recomputing "
                                    f"{self.status or 'every'} row(s) needs force")


@attrs.frozen
class RetryPlan:
    """A checked retry: the table, the rows chosen and what its last recorded map ran."""

    table_namespace: str
    selection: RetrySelection
    spec: RetrySpec


async def prepare_retry(port: Port, play: str, table_namespace: str,
                        selection: RetrySelection) -> RetryPlan:
    """Check a retry before anything is written: the selection, and a recorded spec for the
    table (read through the action of the retry's claim); `InvalidInputError` otherwise."""
    if not isinstance(selection, RetrySelection):
        raise InvalidInputError(f"selection must be a RetrySelection, got {selection!r}")
    namespace = normalize_namespace(table_namespace)
    spec = await retry_spec(port, PlayScope(port.org_id, play), namespace,
                            force=selection.force)
    if spec is None:
        raise InvalidInputError(
            f"no map of table {namespace!r} in play {play!r} recorded a function workers can "
            "find by name (a top-level function of the play file): run the play again")
    return RetryPlan(namespace, selection, spec)


async def retry_table(run: Run, plan: RetryPlan, *,
                      on_progress: Callable[[MapProgress], object] | None = None) -> MapResult:
    """Run the plan's rows again as a shared map of `run` (see the module docstring)."""
    selection, namespace = plan.selection, plan.table_namespace
    config = decode_config(plan.spec.config)
    inputs = list(config.contract.inputs)
    rows: list[JsonObject] = []
    source = dataset(run.port, run.scope.play_scope, namespace, status=selection.status,
                     run_id=selection.run_id, fields=inputs)
    async for row in source.iterate(PAGE_ROWS):
        rows.append({**{field: row.get(field) for field in inputs}, "_key": row["_key"]})
    limit = config.rate_limit
    if limit is not None and limit.key is not None and limit.key.startswith("shared-map:"):
        limit = attrs.evolve(limit, key=None)  # the old map's bucket: this map gets its own
    identity = FunctionIdentity(plan.spec.play_file, plan.spec.function, digest="", keyed=True)
    options = MapOptions(
        concurrency=config.concurrency, cell_policies=config.cell_policies, retry=config.retry,
        row_timeout_s=config.row_timeout_s, rate_limit=limit,
        give_up_after=config.give_up_after, force=selection.force, shared=True,
        on_progress=on_progress, fail_fast=False)
    return await run.map(namespace, rows, PublishedFunction(identity), contract=config.contract,
                         options=options)


RETRY_CONNECTIONS = 4  # a retry's coordinator: staging, publication, progress reads


@attrs.define(eq=False)
class RetryHost:
    """Hosts the coordinators of a console's retries in `nursery` (see the module docstring)."""

    dsn: str | None
    schema: str
    nursery: trio.Nursery

    async def start(self, order: RetryOrder) -> str:
        """Start the retry `order`; its run id once registered (`InvalidInputError` when
        refused, before anything is written)."""
        return await self.nursery.start(self._coordinate, order)

    async def _coordinate(self, order: RetryOrder, *,
                          task_status=trio.TASK_STATUS_IGNORED) -> None:
        selection = RetrySelection(order.status, None, order.force)
        async with open_tenant(order.org, self.dsn, schema=self.schema,
                               max_connections=RETRY_CONNECTIONS) as tenant:
            plan = await prepare_retry(tenant, order.play, order.table, selection)
            started = False
            try:
                async with open_run(tenant, order.play) as run:
                    task_status.started(run.run_id)
                    started = True
                    result = await retry_table(run, plan)
                log.info("retry run %s of %s/%s: %d completed, %d failed", run.run_id,
                         order.play, order.table, result.completed, result.failed)
            except Exception as exc:  # once started, its run's history says how it ended
                if not started:
                    raise
                log.warning("retry of %s/%s ended: %s", order.play, order.table, exc)
