"""What a retry of a table runs: the function and policies its last map recorded.

- Every map writes a spec with its run-history entry (`history.MapRecord.spec`): the function's
  qualified name and play file, as `runplane worker` finds them, and the map's contract and row
  policies as a shared map's configuration (`actors.shared.config.map_spec`). A map whose
  function cannot be found by name (a lambda, a function defined inside another) records none,
  and its table cannot be retried: the play is run again instead.
- `retry_spec(port, scope, table_namespace, force=...)` reads the newest recorded spec of the
  table's maps in the play (one read of the play's history rows, by its primary-key
  prefix), or None when no map of it recorded one.
- It is served as two actions named after the token claims that allow what follows them:
  `maps.retry_failed` (re-run a table's failed rows) and `maps.force` (recompute rows, finished
  ones too). The console checks the same two claims. The retry itself is then published through
  the shared-map actions, which a token must allow as well.
"""

from __future__ import annotations

import json

import attrs

from ..actions import action
from ..canonical import JsonObject
from ..errors import InvalidInputError
from ..ports import RECEIPTS_LANE, Port, table, with_connection
from ..values.codecs import PLAY_SCOPE, RAW, STR, TEXT, optional, record
from ..values.scopes import PlayScope, check_scope, normalize_namespace

RETRY_FAILED = "maps.retry_failed"  # the claim (and action) of a retry of failed rows
FORCE = "maps.force"                # the claim (and action) of a recompute


@attrs.frozen
class RetrySpec:
    """What the table's last recorded map ran: `function` (qualified name) in `play_file`, with
    `config`, the shared-map configuration of its contract and policies."""

    function: str
    play_file: str
    config: JsonObject

    @classmethod
    def from_json(cls, spec: JsonObject) -> RetrySpec:
        function, play_file = spec.get("function"), spec.get("play_file")
        config = spec.get("config")
        if not (isinstance(function, str) and isinstance(play_file, str)
                and isinstance(config, dict)):
            raise InvalidInputError("a recorded map spec needs function, play_file and config")
        return cls(function, play_file, config)

    def to_json(self) -> JsonObject:
        return {"function": self.function, "play_file": self.play_file, "config": self.config}


RETRY_SPEC = record(RetrySpec, function=STR, play_file=STR, config=RAW)

_LATEST = """
SELECT spec::text FROM {run_maps}
 WHERE org_id = $1 AND play = $2 AND table_namespace = $3 AND spec IS NOT NULL
 ORDER BY started_at DESC
 LIMIT 1
"""


async def _latest(port: Port, scope: PlayScope, table_namespace: str) -> RetrySpec | None:
    check_scope(port, scope)
    if not isinstance(table_namespace, str) or not table_namespace:
        raise InvalidInputError("table_namespace must be a non-empty string")
    namespace = normalize_namespace(table_namespace)
    sql = _LATEST.format(run_maps=table(port, "run_maps"))
    text = await with_connection(port, RECEIPTS_LANE, lambda conn: conn.fetchval(
        sql, scope.org_id, scope.play, namespace))
    return None if text is None else RetrySpec.from_json(json.loads(text))


@action(RETRY_FAILED, params={"scope": PLAY_SCOPE, "table_namespace": TEXT},
        result=optional(RETRY_SPEC), writes=False)
async def retry_failed_spec(port: Port, scope: PlayScope,
                            table_namespace: str) -> RetrySpec | None:
    """The spec a retry of the table's failed rows publishes (None: no map recorded one)."""
    return await _latest(port, scope, table_namespace)


@action(FORCE, params={"scope": PLAY_SCOPE, "table_namespace": TEXT},
        result=optional(RETRY_SPEC), writes=False)
async def force_spec(port: Port, scope: PlayScope, table_namespace: str) -> RetrySpec | None:
    """The spec a recompute of the table's rows publishes (None: no map recorded one)."""
    return await _latest(port, scope, table_namespace)


async def retry_spec(port: Port, scope: PlayScope, table_namespace: str, *,
                     force: bool = False) -> RetrySpec | None:
    """The table's newest recorded spec, through the action its kind of retry needs."""
    if force:
        return await force_spec(port, scope, table_namespace)
    return await retry_failed_spec(port, scope, table_namespace)
