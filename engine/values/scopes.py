"""Scopes: who a piece of durable state belongs to.

`PlayScope` ⊂ `RunScope` ⊂ `MapScope`, each a frozen value whose parts are stripped of
surrounding whitespace and then obey the identifier limits of `engine.limits.inputs` (never empty,
at most 256 UTF-8 bytes, no NUL, lone surrogate or control character; `ScopeError` otherwise). Engine operations call
`check_scope(port, scope)` before any query so a scope can never reach another org's rows.
Table namespaces are stored normalized (`normalize_namespace`).
"""

from __future__ import annotations

import re

import attrs

from ..errors import ScopeError
from ..limits.inputs import identifier_problem

_NAMESPACE_JUNK = re.compile(r"[^a-z0-9_]+")


def _part(name: str):
    def convert(value: object) -> str:
        if not isinstance(value, str):
            raise ScopeError(f"{name} must be a string, got {type(value).__name__}")
        stripped = value.strip()
        problem = identifier_problem(stripped)
        if problem is not None:
            raise ScopeError(f"{name} {problem}")
        return stripped

    return convert


def normalize_namespace(table_namespace: str) -> str:
    """Lower case; every run of characters outside [a-z0-9_] becomes one `_`."""
    cleaned = _NAMESPACE_JUNK.sub("_", _part("table_namespace")(table_namespace).lower())
    if not cleaned.strip("_"):
        raise ScopeError(f"table namespace {table_namespace!r} has no letters or digits")
    return cleaned


@attrs.frozen
class PlayScope:
    org_id: str = attrs.field(converter=_part("org_id"))
    play: str = attrs.field(converter=_part("play"))


@attrs.frozen
class RunScope:
    org_id: str = attrs.field(converter=_part("org_id"))
    play: str = attrs.field(converter=_part("play"))
    run_id: str = attrs.field(converter=_part("run_id"))

    @property
    def play_scope(self) -> PlayScope:
        return PlayScope(self.org_id, self.play)

    def map(self, table_namespace: str, map_invocation_id: str) -> "MapScope":
        return MapScope(self.org_id, self.play, self.run_id, table_namespace, map_invocation_id)


@attrs.frozen
class MapScope:
    org_id: str = attrs.field(converter=_part("org_id"))
    play: str = attrs.field(converter=_part("play"))
    run_id: str = attrs.field(converter=_part("run_id"))
    table_namespace: str = attrs.field(converter=normalize_namespace)
    map_invocation_id: str = attrs.field(converter=_part("map_invocation_id"))

    @property
    def play_scope(self) -> PlayScope:
        return PlayScope(self.org_id, self.play)

    @property
    def run_scope(self) -> RunScope:
        return RunScope(self.org_id, self.play, self.run_id)


@attrs.frozen
class RunRef:
    """A registered run: its scope and its fencing epoch (larger is newer)."""

    scope: RunScope
    epoch: int

    @property
    def run_id(self) -> str:
        return self.scope.run_id


def check_scope(port, scope: PlayScope | RunScope | MapScope | RunRef) -> None:
    """Raise `ScopeError` unless `scope` belongs to the org the port serves."""
    if isinstance(scope, RunRef):
        scope = scope.scope
    if scope.org_id != port.org_id:
        raise ScopeError(
            f"scope org {scope.org_id!r} is outside the execution scope (org {port.org_id!r})"
        )
