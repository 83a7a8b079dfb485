"""A list map's opening reads in one request: its sheet ensured, its array input's manifest and
the sheet's row count (`open_list_map`).

How it works
- A map over a list begins with three independent calls: `ensure_sheet`, the array input's
  `get_manifest` (a wake finds its input staged) and `summary` (a list going into an empty
  sheet is not probed). On a direct port they run at once on three connections; through a
  gateway each is a request, and a small run's fixed cost is mostly requests. This action makes
  them one, on the server's port: one read tells whether the sheet is ready for the contract
  and its row total (`ensure.ready_statement`: no lock, no write), `ensure_sheet` runs only
  when it is not, then the manifest is read. A map of a known sheet opens in two statements.
- Each part keeps its own semantics: a failing `ensure_sheet` (or readiness read) fails the
  action; a retired run is an answer (no manifest: the map admits its list without staging),
  not an error.
- A one-page list may come with the call (`stage`: its fingerprint, row count, identities flag
  and encoded page). When its input is `absent` and the sheet held no rows as the readiness
  read found it (every row of the list will be admitted and run, so the map would stage it
  before its first unit anyway), the action begins, puts and seals it (`put_and_seal`) and
  answers the sealed manifest: a small list's first run opens and stages in one request, not
  two. A sheet with rows (a rerun: its rows may all be settled, and a settled rerun writes no
  array input) or an input already begun is left as it is: the map stages as without it.
- Its name is an array-input action's, so a gateway started without array actions refuses it
  as it refuses the others (`ArrayInputUnavailableError`): the caller then opens the map with
  the three calls (`actors.list_source`).
"""

from __future__ import annotations

import attrs

from .. import array_input
from ..actions import action
from ..array_input import values as V
from ..errors import InvalidInputError, RetiredError
from ..ports import SHEET_LANE, Port, with_connection
from ..array_input import pages as P
from ..array_input.sealing import put_and_seal
from ..values.codecs import BOOL, INT, MAP_SCOPE, STR, optional, record
from ..values.scopes import MapScope, check_scope

from .ensure import LAYOUT, ensure_sheet, ready_statement
from .layout import SheetLayout, layout_for
from .model import CONTRACT, SheetContract


@attrs.frozen
class ListMapOpening:
    """What `open_list_map` read: where the sheet lives, the input's manifest (None: the run
    is retired) and the sheet's rows as the map began (None: not asked)."""

    layout: SheetLayout
    manifest: V.Manifest | None
    sheet_rows: int | None


@attrs.frozen
class OnePageList:
    """A one-page list a map's opening may stage (`open_list_map`'s `stage`): what
    `array_input.put_and_seal` takes with its begin fields."""

    source_fingerprint: str
    source_rows: int
    has_source_identities: bool
    page: P.EncodedPage | P.DeferredPage = attrs.field(repr=False)

    def encoded_page(self) -> P.EncodedPage:
        """The page, checked (one from the wire only now: an opening into a sheet that holds
        rows carries a page it does not stage)."""
        return self.page.page() if isinstance(self.page, P.DeferredPage) else self.page


ONE_PAGE_LIST = record(OnePageList, source_fingerprint=STR, source_rows=INT,
                       has_source_identities=BOOL, page=P.DEFERRED_PAGE)

OPENING = record(ListMapOpening, layout=LAYOUT, manifest=optional(V.MANIFEST),
                 sheet_rows=optional(INT))


@action("array_input.open_list_map", params={
    "scope": MAP_SCOPE, "contract": CONTRACT, "count_rows": BOOL,
    "stage": optional(ONE_PAGE_LIST),
}, result=OPENING, deadline_s=75.0)
async def open_list_map(port: Port, scope: MapScope, contract: SheetContract,
                        count_rows: bool = False, stage: OnePageList | None = None
                        ) -> ListMapOpening:
    """Ensure the sheet of `scope` (`ensure_sheet`), read its array input's manifest and, with
    `count_rows`, the sheet's row count: a list map's opening, in one call. With `stage`, a
    one-page list going into an empty sheet is staged too (module docstring)."""
    check_scope(port, scope)
    if not isinstance(contract, SheetContract):
        raise InvalidInputError("contract must be a SheetContract")
    if stage is not None and not isinstance(stage, OnePageList):
        raise InvalidInputError("stage must be a OnePageList")
    layout = layout_for(port, scope.play_scope, scope.table_namespace)
    sql, args = ready_statement(port, layout, contract)
    ready = await with_connection(port, SHEET_LANE, lambda conn: conn.fetchrow(sql, *args))
    if not ready["ready"]:
        layout = await ensure_sheet(port, scope.play_scope, scope.table_namespace, contract)
    manifest: V.Manifest | None = None
    try:
        manifest = await array_input.get_manifest(port, scope)
        if stage is not None and manifest.state == "absent" and ready["total"] == 0:
            manifest = await put_and_seal(
                port, scope, source_fingerprint=stage.source_fingerprint,
                source_rows=stage.source_rows, page=stage.encoded_page(),
                has_source_identities=stage.has_source_identities)
    except RetiredError:
        manifest = None
    # the total was read with the readiness, before `ensure_sheet` (which adds no rows)
    return ListMapOpening(layout, manifest, ready["total"] if count_rows else None)
