"""A list source of `run.map`: encoded once, keyed once, staged only once some row must run.

How it works
- `ListSource.encode` encodes the caller's list once (`engine.array_input.encode_source`, in a
  worker thread: no permit is held meanwhile): canonical texts, page cuts and fingerprint. Row
  keys come from those texts (`sheets.text_key`, what admission would compute), and the rows a
  worker runs are the encoded rows — byte-identical to what the staged page facts store, so
  running them *is* replaying the staged input (a wake passes the same list; the sealed
  manifest's fingerprint proves it, `ConflictError` otherwise).
- Pages are the array input's pages (`cuts`), so page `k` of the map is page fact `k`.
- Staging is lazy: the mapper's admission first probes a page by its keys (read-only); only
  when some row of some page must be admitted does it call `ensure_staged`, which stages and
  seals the whole list (`actors.sealer.stage_encoded`) before that page is admitted. A rerun
  whose every row is already settled therefore writes no array input at all — nothing of it
  will run, so nothing needs replaying. A map whose manifest is already `staging` or `sealed`
  (a wake) is (re)staged at once, so a wake always checks the list against the staged one.
- Once staged, a page is admitted from its stored fact (`StagedPage`: the rows are not sent
  again). Two cases admit the list directly instead, as a streamed source would: a gateway
  without array actions (one warning: a wake re-reads the caller's list), and a run already
  retired (a wake of a finished run: its staged input is gone and nothing will replay it).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Sequence

import attrs
import trio

from runplane.engine import array_input
from runplane.engine.errors import ArrayInputUnavailableError, RetiredError
from runplane.engine.ports import Port
from runplane.engine.scopes import MapScope
from runplane.engine.sheets import StagedPage
from runplane.engine.scopes import normalize_namespace

from .retry import retry_transient
from .sealer import stage_encoded

log = logging.getLogger("runplane.actors")


def encode_and_key(items: list[Any], table_namespace: str) -> tuple[Any, list[str]]:
    """The encoded source and each row's sheet key (pure CPU, run in a worker thread)."""
    encoded = array_input.encode_source(items)
    prefix = f"{normalize_namespace(table_namespace)}\n".encode()
    sha256 = hashlib.sha256
    # == sheets.inputs.text_key for each text, with the namespace normalized once
    return encoded, [sha256(prefix + text.encode()).hexdigest()[:32] for text in encoded.texts]


@attrs.frozen
class SourcePage:
    """One page for admission: its rows, their input offset, and for a list source the row
    keys and the page's ordinal in the staged input."""

    offset: int
    rows: list[dict]
    keys: list[str] | None = None
    ordinal: int | None = None


@attrs.define(eq=False)
class ListSource:
    """An encoded list source and whether (and how) it is staged; see the module docstring."""

    port: Port
    scope: MapScope
    encoded: Any  # array_input.EncodedSource
    keys: list[str] = attrs.field(repr=False)
    manifest: Any = None
    mode: str = "unstaged"  # unstaged → staged | direct
    _staging: trio.Lock = attrs.field(init=False, factory=trio.Lock)

    @classmethod
    async def encode(cls, port: Port, scope: MapScope, items: Sequence[Any]) -> ListSource:
        """Encode `items` (bad rows raise `InvalidInputError` before any query)."""
        encoded, keys = await trio.to_thread.run_sync(encode_and_key, list(items),
                                                      scope.table_namespace)
        return cls(port, scope, encoded, keys)

    async def open(self) -> None:
        """Read the manifest: a map already staged (a wake) is resumed or checked at once."""
        try:
            self.manifest = await retry_transient(
                lambda: array_input.get_manifest(self.port, self.scope))
        except RetiredError:
            self._admit_directly_retired()
            return
        except ArrayInputUnavailableError:
            self._admit_directly_no_arrays()
            return
        if self.manifest.state != "absent":
            await self.ensure_staged()

    @property
    def source_rows(self) -> int:
        return self.encoded.source_rows

    def page_groups(self, group_rows: int):
        """The pages in order, as lists of consecutive `SourcePage`s of at most `group_rows`
        rows together (one page at least): rows and keys are slices of the encoded source."""
        rows, keys = self.encoded.rows, self.keys
        group: list[SourcePage] = []
        size = 0
        for ordinal, (offset, count) in enumerate(self.encoded.cuts):
            if group and size + count > group_rows:
                yield group
                group, size = [], 0
            group.append(SourcePage(offset, rows[offset:offset + count],
                                    keys[offset:offset + count], ordinal))
            size += count
        if group:
            yield group

    async def ensure_staged(self) -> None:
        """Stage and seal the list unless it is (or cannot be)."""
        async with self._staging:
            if self.mode != "unstaged":
                return
            try:
                staged = await stage_encoded(self.port, self.scope, self.encoded,
                                             manifest=self.manifest)
            except ArrayInputUnavailableError:
                self._admit_directly_no_arrays()
                return
            except RetiredError:
                self._admit_directly_retired()
                return
            self.manifest = staged.manifest
            self.mode = "staged"

    async def staged_page(self, page: SourcePage) -> StagedPage | None:
        """The staged page fact to admit `page` from (staging first), or None to send rows."""
        await self.ensure_staged()
        if self.mode != "staged" or page.ordinal is None:
            return None
        # CPU: one join and one hash of the page's texts, no JSON encoding
        return StagedPage(self.scope, page.ordinal, self.encoded.page(page.ordinal).digest)

    def _admit_directly_no_arrays(self) -> None:
        self.mode = "direct"
        log.warning("map %s: the gateway has no array-input actions; the list is admitted "
                    "directly, and a wake will re-read the caller's list instead of staged "
                    "pages", self.scope.table_namespace)

    def _admit_directly_retired(self) -> None:
        self.mode = "direct"
        log.info("map %s: run %s is retired; admitting the list without staging",
                 self.scope.table_namespace, self.scope.run_id)
