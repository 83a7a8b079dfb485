"""A list source of `run.map`: encoded once, keyed once, staged only once some row must run.

How it works
- A settled rerun needs no encoding: the mapper first probes the list's leading rows as given
  (`rows_between`, read-only), and only at the first rows that are not all settled does it
  call `encode`, which encodes the whole list once (`engine.array_input.encode_source`, in a
  worker thread: no permit is held meanwhile) — a bad row raises `InvalidInputError` then,
  before anything is written. Row keys come from the canonical texts (what admission would
  compute; unit by unit, as admission reaches them), a unit is admitted with the texts so
  admission does not encode its rows again, and the rows a worker runs are the encoded rows —
  byte-identical to what the staged page facts store, so running them *is* replaying the
  staged input (a wake passes the same list; the begin fact's fingerprint proves it,
  `ConflictError` otherwise).
- The map reads the sheet's row count as it begins (`count_sheet_rows`): a list going into an
  empty sheet is not probed at all, and is encoded at once (while the sheet is ensured).
  Through a gateway, the sheet, the manifest and the row count are one request
  (`open_with_sheet`).
- Admission units: consecutive pages of the array input, up to the map's `page_rows` rows and
  `MAX_UNIT_PAGES` pages (one transaction each, as large as a streamed page) — from row 0,
  after a ramp of smaller units (`ramp_cuts`: 100 rows, then twice as many each, as a streamed
  source's first pages, so the workers start soon; until the rest fits one unit). A list of
  one page (at most 1,000 rows) has no ramp: it is one unit, admitted from its staged fact
  (its rows are not sent twice), since admitting the whole page takes about as long as the
  ramp's one more transaction (and, through a gateway, one more request); on a wake
  (the input was staged before the map began) one page each, admitted from its stored fact
  (`StagedPage`: the rows are not sent again). A one-page unit of a sealed input is always
  admitted from its fact.
- Staging is lazy: the mapper's admission first probes a unit by its keys (read-only); only
  when some row must be admitted does it stage. `start_staging` writes the begin fact — from
  then on a wake must pass this very list (same fingerprint, `ConflictError` otherwise), so a
  row may run — and puts and seals the pages in the background (in the map's nursery, so the
  map ends only once the input is sealed) while admission goes on with the rows sent; a
  one-page list is begun, put and sealed in one request before its first unit. A rerun
  whose every row is already settled therefore writes no array input at all: nothing of it
  runs, so nothing needs replaying. A map whose manifest is already `staging` or `sealed` (a
  wake) is staged (resumed, or checked) before its first unit, at `open`.
- A `PagedRows` source (a read-only sequence backed by a file, say) is a list source too, never
  copied into a list: its encoding is a `PagedSource` (fingerprint and page cuts from the
  source's checking pass, equal to a list's of the same rows), whose units read and encode
  their pages when admission reaches them, so memory stays a few pages whatever its size.
- Two cases admit the list directly instead, as a streamed source would: a gateway without
  array actions (one warning: a wake re-reads the caller's list), and a run already retired (a
  wake of a finished run: its staged input is gone and nothing will replay it).
"""

from __future__ import annotations

import logging
import attrs
import trio

from runplane.engine import array_input, sheets
from runplane.engine.array_input import Manifest, Occurrence
from runplane.engine.canonical import JsonObject
from runplane.engine.errors import (
    ArrayInputUnavailableError, EngineError, InvalidInputError, RetiredError, ScopeError,
)
from runplane.engine.ports import Port
from runplane.engine.values.scopes import MapScope, PlayScope
from runplane.engine.sheets import StagedPage
from runplane.engine.sheets.inputs import text_keys

from .retry import retry_transient
from .sealer import EncodedList, stage_encoded

log = logging.getLogger("runplane.actors")

MAX_UNIT_PAGES = 5  # an admission unit of a list: at most this many pages (~5 MiB of input)
FIRST_UNIT_ROWS = 100  # a first run's first unit (as a streamed source's first page), ...
# ... each next one twice as large while under half the map's `page_rows`: work starts soon


@attrs.define(eq=False)
class SourcePage:
    """One page for admission: its rows, their input offset, and for a list source the row
    keys, the rows' canonical texts and the page's ordinal in the staged input. A list's unit
    gives its encoded `source` and row count instead of its rows and texts, and its
    `namespace` instead of its keys: each is read (the rows copied, the texts unpacked, the
    keys computed from the texts) when first needed (admission reaches the unit, or a probe of
    its group), not when its group is cut."""

    offset: int
    _rows: list[dict] | None = None  # `rows=` (attrs drops the underscore)
    _keys: list[str] | None = None
    ordinal: int | None = None
    _texts: list[str] | None = None
    namespace: str | None = None
    _source: EncodedList | None = attrs.field(default=None, repr=False)
    _count: int = 0  # the rows of a unit read from its `source`

    @property
    def rows(self) -> list[dict]:
        if self._rows is None:
            self._read()
        return self._rows

    @property
    def texts(self) -> list[str] | None:
        if self._texts is None and self._source is not None:
            self._read()
        return self._texts

    @property
    def size(self) -> int:
        """How many rows the page holds (without reading a unit's rows)."""
        return len(self._rows) if self._rows is not None else self._count

    @property
    def keys(self) -> list[str] | None:
        if self._keys is None and self.namespace is not None and self.texts is not None:
            self._keys = text_keys(self.namespace, self.texts)
        return self._keys

    def _read(self) -> None:
        assert self._source is not None, "a page without rows reads them from its source"
        self._rows, self._texts = self._source.span(self.offset, self.offset + self._count)


def ramp_cuts(unit_rows: int, source_rows: int) -> frozenset[int]:
    """Offsets ending a list's first units: `FIRST_UNIT_ROWS` rows, then twice as many each,
    while under half `unit_rows` (then units of whole pages as usual), and only while the
    rest of the list does not fit one unit: the ramp lets the workers start before the large
    units are written, and once the rest is one unit more cuts only add transactions (a
    1,000-row list is admitted in two, not four: requests a gateway answers)."""
    cuts, size, low = set(), FIRST_UNIT_ROWS, 0
    while size < unit_rows // 2:
        low += size
        cuts.add(low)
        size *= 2
        if source_rows - low <= unit_rows:
            break
    return frozenset(cuts)


@attrs.define(eq=False)
class ListSource:
    """A list source, encoded when first needed, and whether (and how) it is staged; see the
    module docstring."""

    port: Port
    scope: MapScope
    items: list[JsonObject | Occurrence] | array_input.PagedRows = attrs.field(repr=False)
    encoded: EncodedList | None = attrs.field(default=None, repr=False)
    keys: list[str] | None = attrs.field(default=None, repr=False)  # all keys, if computed
    manifest: Manifest | None = None
    mode: str = "unstaged"  # unstaged → (staging →) staged | direct
    begun: bool = False  # this map wrote its begin fact (`start_staging`)
    sheet_rows: int | None = None  # rows in the sheet as the map began (a hint; None: unknown)
    replaying: bool = False  # staged before the map began: pages are admitted from facts
    woken: bool = False  # its manifest was staging or sealed as the map began (a wake)
    _encoding: trio.Lock = attrs.field(init=False, factory=trio.Lock)
    _staging: trio.Lock = attrs.field(init=False, factory=trio.Lock)
    _sealed: trio.Event = attrs.field(init=False, factory=trio.Event)

    async def encode(self) -> None:
        """Encode the list once, in a worker thread (bad rows raise `InvalidInputError`, naming
        the row); a second caller meanwhile waits for the first's. Keys are computed unit by
        unit as admission reaches them (`page_groups`), so the first row waits for the
        encoding only."""
        async with self._encoding:
            if self.encoded is None:
                self.encoded = await trio.to_thread.run_sync(array_input.encode_source,
                                                             self.items)

    async def count_sheet_rows(self, scope: PlayScope) -> None:
        """Read how many rows the sheet holds (`sheet_rows`), a hint for probing: a sheet with
        none settles nothing. Unknown if the read fails (probing then goes on as without it)."""
        try:
            counters = await sheets.summary(self.port, scope, self.scope.table_namespace)
        except EngineError as exc:
            log.debug("map %s: the sheet's counters could not be read (%s)",
                      self.scope.table_namespace, exc)
            return
        self.sheet_rows = counters.total

    def rows_between(self, low: int, high: int) -> list[dict]:
        """The user rows of items `low` to `high` as given (for a probe before encoding)."""
        rows = []
        high = min(high, len(self.items))
        given = self.items[low:high] if isinstance(self.items, array_input.PagedRows) else \
            (self.items[index] for index in range(low, high))
        for index, item in enumerate(given, low):
            if type(item) is not dict:
                if isinstance(item, Occurrence):
                    item = item.data
                elif not isinstance(item, dict):
                    raise InvalidInputError(
                        f"rows[{index}] must be a dict or an Occurrence, got {type(item).__name__}")
            rows.append(item)
        return rows

    async def open(self) -> None:
        """Read the manifest: a map already staged (a wake) is encoded and resumed or checked
        at once."""
        try:
            manifest = await retry_transient(
                lambda: array_input.get_manifest(self.port, self.scope))
        except RetiredError:
            self._admit_directly_retired()
            return
        except ArrayInputUnavailableError:
            self._admit_directly_no_arrays()
            return
        await self._opened(manifest)

    async def open_with_sheet(self, contract: sheets.SheetContract, count_rows: bool) -> bool:
        """Through a gateway: ensure the sheet, read the manifest and (`count_rows`) the
        sheet's rows in one request (the action `array_input.open_list_map`), then open as
        `open` does. False when the gateway refuses that action (no array actions, or a token
        that does not allow it): nothing is done, and the caller opens the map with the three
        calls."""
        try:
            opening = await retry_transient(lambda: sheets.open_list_map(
                self.port, self.scope, contract, count_rows))
        except (ArrayInputUnavailableError, ScopeError):
            return False
        self.sheet_rows = opening.sheet_rows
        if opening.manifest is None:
            self._admit_directly_retired()
        else:
            await self._opened(opening.manifest)
        return True

    async def _opened(self, manifest: Manifest) -> None:
        self.manifest = manifest
        if manifest.state != "absent":
            self.woken = True
            await self.encode()
            await self.ensure_staged()
            self.replaying = self.mode == "staged"

    @property
    def source_rows(self) -> int:
        return len(self.items)

    def page_groups(self, group_rows: int, unit_rows: int, start: int = 0,
                    cut_at: frozenset[int] = frozenset()):
        """The source from row `start` on, as groups (lists) of admission units (`SourcePage`).

        A unit is one page when the input was staged before the map began (a wake: each page
        is admitted from its fact), else consecutive pages up to `unit_rows` rows and
        `MAX_UNIT_PAGES` pages (one page at least): one admission transaction each, as large
        as a streamed page. A unit never spans a row offset in `cut_at` (nor `start`): a page
        such an offset falls in is split there. Only a unit that is one whole page carries its
        ordinal (it may be admitted from its fact). A group holds consecutive units up to
        `group_rows` rows (one at least), the reach of one probe. From row 0 and unless
        replaying, the first units of a list of more than one page ramp up (`ramp_cuts`) so
        the workers get rows soon. Rows and texts are spans of the encoded source, read when
        the unit is first used; a unit's keys too when all were computed, else computed from
        its texts when first read.
        """
        namespace = self.scope.table_namespace
        per_unit = 1 if self.replaying else MAX_UNIT_PAGES
        if not self.replaying and start == 0 and len(self.encoded.cuts) > 1:
            cut_at = cut_at | ramp_cuts(unit_rows, self.source_rows)
        cuts = sorted(offset for offset in cut_at if offset > start)

        def segments():
            """(offset, count, ordinal or None for part of a page), split at the cuts."""
            i = 0
            for ordinal, (offset, count) in enumerate(self.encoded.cuts):
                low, high = max(offset, start), offset + count
                if high <= low:
                    continue
                while i < len(cuts) and cuts[i] <= low:
                    i += 1
                while i < len(cuts) and cuts[i] < high:
                    yield low, cuts[i] - low, None
                    low = cuts[i]
                    i += 1
                whole = low == offset and high == offset + count
                yield low, high - low, ordinal if whole else None

        cut_points = set(cuts)
        group: list[SourcePage] = []
        group_size = 0
        unit: list[tuple[int, int, int | None]] = []

        def close() -> SourcePage:
            low = unit[0][0]
            high = low + sum(count for _, count, _ in unit)
            ordinal = unit[0][2] if len(unit) == 1 else None
            keys = self.keys[low:high] if self.keys is not None else None
            return SourcePage(low, None, keys, ordinal, None, namespace if keys is None else None,
                              self.encoded, high - low)

        for segment in segments():
            low, count, _ = segment
            if unit and (len(unit) >= per_unit or low in cut_points
                         or sum(c for _, c, _ in unit) + count > unit_rows):
                done = close()
                if group and group_size + done.size > group_rows:
                    yield group
                    group, group_size = [], 0
                group.append(done)
                group_size += done.size
                unit = []
            unit.append(segment)
        if unit:
            done = close()
            if group and group_size + done.size > group_rows:
                yield group
                group = []
            group.append(done)
        if group:
            yield group

    async def ensure_staged(self) -> None:
        """Stage and seal the list unless it is (or cannot be); waits for a staging that is
        under way in the background."""
        async with self._staging:
            if self.mode == "unstaged":
                await self._stage()
        if self.mode == "staging":
            await self._sealed.wait()

    async def _stage(self) -> None:
        try:
            staged = await stage_encoded(self.port, self.scope, self.encoded,
                                         manifest=self.manifest, begun=self.begun)
        except ArrayInputUnavailableError:
            self._admit_directly_no_arrays()
            return
        except RetiredError:
            self._admit_directly_retired()
            return
        finally:
            self._sealed.set()
        self.manifest = staged.manifest
        self.mode = "staged"

    async def start_staging(self, nursery: trio.Nursery) -> None:
        """Write the begin fact (so a wake must pass this very list), then put and seal the
        pages in the background (`nursery`): rows may run meanwhile, their pages admitted with
        their rows until the seal exists. A one-page list (at most `MAX_PAGE_ROWS` rows) is
        begun, put and sealed at once instead, in one request."""
        async with self._staging:
            if self.mode != "unstaged":
                return
            encoded = self.encoded
            if encoded.page_count == 1:
                await self._stage()
                return
            try:
                await retry_transient(lambda: array_input.begin(
                    self.port, self.scope, source_fingerprint=encoded.fingerprint,
                    source_rows=encoded.source_rows,
                    has_source_identities=encoded.has_source_identities))
            except ArrayInputUnavailableError:
                self._admit_directly_no_arrays()
                return
            except RetiredError:
                self._admit_directly_retired()
                return
            self.mode = "staging"
            self.begun = True  # the stager neither reads the manifest nor begins again
            nursery.start_soon(self._stage, name="stage_list")

    async def staged_page(self, page: SourcePage,
                          nursery: trio.Nursery | None = None) -> StagedPage | None:
        """The staged page fact to admit `page` from, or None to send its rows. The first call
        starts staging: in the background with a `nursery` (None until it is sealed), else
        waiting for the seal."""
        if nursery is None:
            await self.ensure_staged()
        elif self.mode == "unstaged":
            await self.start_staging(nursery)
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
