"""The array sealer: stage a map's list input as immutable pages, seal it, replay it.

How it works
- `stage_array(port, MapScope, occurrences)` first reads the manifest:
  * `sealed`  → nothing to write: the staged input is replayed as stored, once the caller's list
    is proven to be the one staged (same fingerprint, row count and identities flag); a
    different list raises `ConflictError` (a wake never replays other input);
  * `absent` or `staging` → `begin` (idempotent; a different source raises `ConflictError`), then
    the pages are put by `PUT_TASKS` putter actors that share one bounded channel of page
    ordinals (each put is its own transaction, so a putter holds a permit only for its page; a
    re-put of a page that exists is a no-op), then `seal` verifies every page and writes the
    seal under the run guard. A one-page source is begun, put and sealed in one request
    (`put_and_seal`); one whose begin fact the caller wrote, put and sealed in one.
- The source is encoded once (`array_input.encode_source`: fingerprint, page cuts and each row's
  canonical text in one pass), in a worker thread so the run's other actors keep their event
  loop (no permit is held meanwhile); each putter builds its page fact from those texts
  (`EncodedSource.page`: string joins and one hash, no JSON encoding) and puts it with
  `put_encoded_page`. `stage_encoded` takes a source a caller already encoded (the mapper keeps
  it to key and run the rows).
- The run guard fences every write: once the run is retired, `begin`, `put_page` and `seal`
  raise `RetiredError`, including a seal whose released verification scan was overtaken by the
  retirement.
- Every store call is idempotent and retried through transient faults (`actors.retry`).
- `StagedArray.pages()` reads one page at a time (`read_page` re-verifies its digest), so replay
  holds one page in memory.
"""

from __future__ import annotations

from typing import AsyncIterator, Sequence, Union

import attrs
import trio

from runplane.engine import array_input
from runplane.engine.array_input import EncodedSource, Manifest, Occurrence, Page, PagedSource
from runplane.engine.canonical import JsonObject
from runplane.engine.errors import ConflictError, InvalidInputError
from runplane.engine.ports import Port
from runplane.engine.values.scopes import MapScope

from .phases import marked
from .retry import retry_transient

PUT_TASKS = 3
SEAL_BATCH_PAGES = 4

# A list source encoded once (`array_input.encode_source`): held whole, or read page by page.
EncodedList = Union[EncodedSource, PagedSource]


@attrs.frozen
class StagedArray:
    """A sealed array input: its manifest, and its pages read back one at a time."""

    port: Port = attrs.field(repr=False)
    scope: MapScope
    manifest: Manifest

    @property
    def page_count(self) -> int:
        return self.manifest.page_count

    async def pages(self) -> AsyncIterator[Page]:
        for ordinal in range(self.manifest.page_count):
            yield await retry_transient(
                lambda: array_input.read_page(self.port, self.scope, ordinal))


def check_same_source(scope: MapScope, manifest: Manifest, source: EncodedList) -> None:
    """`ConflictError` unless the caller's (encoded) source is the one staged for `scope`."""
    if (manifest.source_fingerprint, manifest.has_source_identities, manifest.source_rows) != (
        source.fingerprint, source.has_source_identities, source.source_rows
    ):
        raise ConflictError(
            f"the list given to map invocation {scope.map_invocation_id!r} of "
            f"{scope.table_namespace!r} differs from the input staged for it "
            f"({source.source_rows} rows given, {manifest.source_rows} staged): a wake must pass "
            "the same list"
        )


async def stage_array(port: Port, scope: MapScope, occurrences: Sequence[Occurrence | JsonObject],
                      *, put_tasks: int = PUT_TASKS) -> StagedArray:
    """Stage, resume or replay the array input of `scope`; return it sealed."""
    if not isinstance(occurrences, (list, tuple)):
        raise InvalidInputError(
            f"occurrences must be a list, got {type(occurrences).__name__}"
        )
    manifest = await retry_transient(lambda: array_input.get_manifest(port, scope))
    source = await trio.to_thread.run_sync(array_input.encode_source, occurrences)
    return await stage_encoded(port, scope, source, manifest=manifest, put_tasks=put_tasks)


@marked("staging")
async def put_pages(port: Port, scope: MapScope, source: EncodedList, ordinals_recv,
                    *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A putter actor: build and put each page whose ordinal it is sent (a permit only inside
    each put)."""
    task_status.started()
    async with ordinals_recv:
        async for ordinal in ordinals_recv:
            offset, _count = source.cuts[ordinal]
            page = source.page(ordinal)  # CPU: string joins and one hash, no JSON encoding
            await retry_transient(lambda: array_input.put_encoded_page(
                port, scope, source_fingerprint=source.fingerprint, ordinal=ordinal,
                offset=offset, page=page,
            ))


@marked("staging")
async def put_and_seal(port: Port, scope: MapScope, source: EncodedList, *,
                       begin: bool = False) -> Manifest:
    """A one-page source's page put and the source sealed, in one request; with `begin`, its
    begin fact written first in the same request."""
    identities = source.has_source_identities if begin else None
    return await retry_transient(lambda: array_input.put_and_seal(
        port, scope, source_fingerprint=source.fingerprint, source_rows=source.source_rows,
        page=source.page(0), has_source_identities=identities))


async def stage_encoded(port: Port, scope: MapScope, source: EncodedList, *,
                        manifest: Manifest | None = None, begun: bool = False,
                        put_tasks: int = PUT_TASKS) -> StagedArray:
    """Stage (or resume) an encoded source; return it sealed. A `manifest` already read saves
    a round trip; `begun=True` (the caller just wrote this source's begin fact) saves two.
    An input already sealed must be this source (`ConflictError` otherwise); one begun with
    this source (a wake of a map that began staging it) is not begun again."""
    if not begun:
        if manifest is None:
            manifest = await retry_transient(lambda: array_input.get_manifest(port, scope))
        if manifest.state == "sealed":
            check_same_source(scope, manifest, source)
            return StagedArray(port, scope, manifest)
        begun = manifest.state == "staging" and manifest.source_fingerprint == source.fingerprint
    if not begun:
        if source.page_count == 1:  # begun, put and sealed in one request
            return StagedArray(port, scope, await put_and_seal(port, scope, source, begin=True))
        await retry_transient(lambda: array_input.begin(
            port, scope, source_fingerprint=source.fingerprint, source_rows=source.source_rows,
            has_source_identities=source.has_source_identities))
    if source.page_count == 1:  # put and sealed in one request
        return StagedArray(port, scope, await put_and_seal(port, scope, source))
    async with trio.open_nursery() as nursery:
        # Capacity: an ordinal per putter waiting, so a putter never idles between pages.
        ordinals_send, ordinals_recv = trio.open_memory_channel(put_tasks)
        async with ordinals_recv:
            for _ in range(put_tasks):
                await nursery.start(put_pages, port, scope, source, ordinals_recv.clone())
        async with ordinals_send:
            for ordinal in range(source.page_count):
                await ordinals_send.send(ordinal)
    sealed = await retry_transient(lambda: array_input.seal(
        port, scope, source_fingerprint=source.fingerprint, source_rows=source.source_rows,
        page_count=source.page_count, batch_size=SEAL_BATCH_PAGES))
    return StagedArray(port, scope, sealed)
