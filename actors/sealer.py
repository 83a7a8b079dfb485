"""The array sealer: stage a map's list input as immutable pages, seal it, replay it.

How it works
- `stage_array(port, MapScope, occurrences)` first reads the manifest:
  * `sealed`  → nothing to write: the staged input is replayed as stored, once the caller's list
    is proven to be the one staged (same fingerprint, row count and identities flag); a
    different list raises `ConflictError` (a wake never replays other input);
  * `absent` or `staging` → `begin` (idempotent; a different source raises `ConflictError`), then
    the pages are put by `PUT_TASKS` putter actors that share one bounded channel of page drafts
    (each `put_page` is its own transaction, so a putter holds a permit only for its page; a
    re-put of a page that exists is a no-op), then `seal` verifies every page and writes the
    seal under the run guard.
- Fingerprinting and pagination are CPU work (canonical encoding), done in a worker thread so
  the run's other actors keep their event loop; no permit is held meanwhile.
- The run guard fences every write: once the run is retired, `begin`, `put_page` and `seal`
  raise `RetiredError`, including a seal whose released verification scan was overtaken by the
  retirement.
- Every store call is idempotent and retried through transient faults (`actors.retry`).
- `StagedArray.pages()` reads one page at a time (`read_page` re-verifies its digest), so replay
  holds one page in memory.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Sequence

import attrs
import trio

from runplane.engine import array_input
from runplane.engine.array_input import Occurrence
from runplane.engine.errors import ConflictError, InvalidInputError
from runplane.engine.ports import Port
from runplane.engine.scopes import MapScope

from .retry import retry_transient

PUT_TASKS = 3
SEAL_BATCH_PAGES = 4


@attrs.frozen
class StagedArray:
    """A sealed array input: its manifest, and its pages read back one at a time."""

    port: Port = attrs.field(repr=False)
    scope: MapScope
    manifest: Any

    @property
    def page_count(self) -> int:
        return self.manifest.page_count

    async def pages(self) -> AsyncIterator[Any]:
        for ordinal in range(self.manifest.page_count):
            yield await retry_transient(
                lambda: array_input.read_page(self.port, self.scope, ordinal))


def as_occurrences(items: Sequence[Any]) -> list[Occurrence]:
    """Occurrences as given, or user rows (dicts) wrapped as occurrences without identity."""
    occurrences = []
    for index, item in enumerate(items):
        if isinstance(item, Occurrence):
            occurrences.append(item)
        elif isinstance(item, dict):
            occurrences.append(Occurrence(item))
        else:
            raise InvalidInputError(
                f"rows[{index}] must be a dict or an Occurrence, got {type(item).__name__}"
            )
    return occurrences


def _describe(items: Sequence[Any]) -> tuple[str, bool, int]:
    """What the begin fact records of a source: fingerprint, identities flag, row count."""
    occurrences = as_occurrences(items)
    identities = any(occ.source_identity is not None for occ in occurrences)
    return array_input.source_fingerprint(occurrences), identities, len(occurrences)


def _prepare(items: Sequence[Any]) -> tuple[str, list[Any], bool, int]:
    occurrences = as_occurrences(items)
    fingerprint, identities, source_rows = _describe(occurrences)
    return fingerprint, list(array_input.paginate(occurrences)), identities, source_rows


def check_same_source(scope: MapScope, manifest: Any, described: tuple[str, bool, int]) -> None:
    """`ConflictError` unless the caller's source is the one sealed for `scope`."""
    fingerprint, identities, source_rows = described
    if (manifest.source_fingerprint, manifest.has_source_identities, manifest.source_rows) != (
        fingerprint, identities, source_rows
    ):
        raise ConflictError(
            f"the list given to map invocation {scope.map_invocation_id!r} of "
            f"{scope.table_namespace!r} differs from the input staged for it ({source_rows} rows "
            f"given, {manifest.source_rows} staged): a wake must pass the same list"
        )


async def put_pages(port: Port, scope: MapScope, fingerprint: str, drafts_recv,
                    *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A putter actor: put each page draft it receives (a permit only inside each put)."""
    task_status.started()
    async with drafts_recv:
        async for draft in drafts_recv:
            await retry_transient(lambda: array_input.put_page(
                port, scope, source_fingerprint=fingerprint, ordinal=draft.ordinal,
                offset=draft.offset, rows=draft.rows,
            ))


async def stage_array(port: Port, scope: MapScope, occurrences: Sequence[Any],
                      *, put_tasks: int = PUT_TASKS) -> StagedArray:
    """Stage, resume or replay the array input of `scope`; return it sealed."""
    if not isinstance(occurrences, (list, tuple)):
        raise InvalidInputError(
            f"occurrences must be a list, got {type(occurrences).__name__}"
        )
    manifest = await retry_transient(lambda: array_input.get_manifest(port, scope))
    if manifest.state == "sealed":
        check_same_source(scope, manifest, await trio.to_thread.run_sync(_describe, occurrences))
        return StagedArray(port, scope, manifest)
    fingerprint, drafts, identities, source_rows = await trio.to_thread.run_sync(
        _prepare, occurrences
    )
    await retry_transient(lambda: array_input.begin(
        port, scope, source_fingerprint=fingerprint, source_rows=source_rows,
        has_source_identities=identities))
    async with trio.open_nursery() as nursery:
        # Capacity: a page draft per putter waiting, so a putter never idles between pages.
        drafts_send, drafts_recv = trio.open_memory_channel(put_tasks)
        async with drafts_recv:
            for _ in range(put_tasks):
                await nursery.start(put_pages, port, scope, fingerprint, drafts_recv.clone())
        async with drafts_send:
            for draft in drafts:
                await drafts_send.send(draft)
    await retry_transient(lambda: array_input.seal(
        port, scope, source_fingerprint=fingerprint, source_rows=source_rows,
        page_count=len(drafts), batch_size=SEAL_BATCH_PAGES))
    return StagedArray(port, scope,
                       await retry_transient(lambda: array_input.get_manifest(port, scope)))
