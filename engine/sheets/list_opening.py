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
from ..values.codecs import BOOL, INT, MAP_SCOPE, optional, record
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


OPENING = record(ListMapOpening, layout=LAYOUT, manifest=optional(V.MANIFEST),
                 sheet_rows=optional(INT))


@action("array_input.open_list_map", params={
    "scope": MAP_SCOPE, "contract": CONTRACT, "count_rows": BOOL,
}, result=OPENING, deadline_s=60.0)
async def open_list_map(port: Port, scope: MapScope, contract: SheetContract,
                        count_rows: bool = False) -> ListMapOpening:
    """Ensure the sheet of `scope` (`ensure_sheet`), read its array input's manifest and, with
    `count_rows`, the sheet's row count: a list map's opening, in one call."""
    check_scope(port, scope)
    if not isinstance(contract, SheetContract):
        raise InvalidInputError("contract must be a SheetContract")
    layout = layout_for(port, scope.play_scope, scope.table_namespace)
    sql, args = ready_statement(port, layout, contract)
    ready = await with_connection(port, SHEET_LANE, lambda conn: conn.fetchrow(sql, *args))
    if not ready["ready"]:
        layout = await ensure_sheet(port, scope.play_scope, scope.table_namespace, contract)
    manifest: V.Manifest | None = None
    try:
        manifest = await array_input.get_manifest(port, scope)
    except RetiredError:
        pass
    # the total was read with the readiness, before `ensure_sheet` (which adds no rows)
    return ListMapOpening(layout, manifest, ready["total"] if count_rows else None)
