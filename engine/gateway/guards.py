"""What the gateway checks so that one org's requests cannot hurt another's: no I/O here but
the registered-run lookup.

How it works
- `loads(raw, what)` decodes a request body as strict JSON: `NaN`, `Infinity` and numbers that
  overflow a float are refused, and so is nesting too deep for the decoder (Python's decoder
  raises `RecursionError` past about 1,000 levels), all as `InvalidInputError` (400).
- `ReplayCache` answers a retried write from the first attempt's answer, but only when the
  retry is the same request: entries are keyed by (org, play, action, request id) and hold a
  digest of the body and of the token's claims (`request_digest`). The same id with another
  body or another token's claims is refused with `ConflictError` (409), never answered from
  the cache, even while the first attempt is still running. Its byte budget counts each
  entry whole (`replay_entry_bytes`: key, digest, answer and a fixed overhead), so small
  answers under long ids cannot grow it past its budget.
- `check_request_id(text)` refuses (`InvalidInputError`, 400, before the body is read) a
  request id longer than `MAX_REQUEST_ID_CHARS` or outside `[A-Za-z0-9._:-]`.
- `RunCheck.check(tenant, run)` refuses a `RunRef` that does not name a registered run of its
  org and play with that epoch (`ConflictError`, before the action runs, so nothing is
  written); a write naming a run by scope alone (`RunScope`, `MapScope`: staging, the outbox)
  is refused the same way when that run was never registered. A registered run's epoch never changes, so a positive answer is cached (bounded,
  oldest out first), by epoch and by scope alone: a run registered through this gateway
  (`runs.register`'s answer is remembered) costs no extra read, another one read on its first
  request through this gateway, none afterwards. A negative answer is never cached (the run may be registered next).
- `scope_of(kwargs)` is the org and play a request's inputs name, checked against the token's
  claims; `named_runs` and `named_run_ids` the runs they name; `check_also_does` checks the
  claim for what an input makes an action do besides (`ALSO_DOES`).
- `bucket(name, known)` is the counter key of an action name: the name itself when it is a
  registered action, else one shared bucket, so unauthenticated requests for made-up names
  cannot grow the server's state or its log line. `printable(text)` escapes what a request
  put in a log line (newlines, control characters) and cuts it short.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import math
import re
import sys
from typing import Awaitable, Callable, Mapping, NoReturn

import attrs
import trio

from .. import runs
from ..canonical import JsonValue
from ..errors import ConflictError, InvalidInputError
from ..ports import Port
from ..tokens import TokenClaims
from ..values.scopes import MapScope, PlayScope, RunRef, RunScope

UNKNOWN_ACTION = "(unknown action)"
REPLAY_TTL_S = 900.0
REPLAY_MAX_BYTES = 256 * 1024 * 1024
RUN_CHECK_ENTRIES = 100_000
LOG_TEXT_CHARS = 120
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,%d}" % MAX_REQUEST_ID_CHARS)
REPLAY_ENTRY_OVERHEAD = 400  # bytes of an entry besides its texts: tuples, dict slot, floats


def check_request_id(text: str) -> None:
    """Refuse a request id past `MAX_REQUEST_ID_CHARS` or outside `[A-Za-z0-9._:-]`."""
    if _REQUEST_ID.fullmatch(text) is None:
        raise InvalidInputError(
            f"the request id must be 1 to {MAX_REQUEST_ID_CHARS} characters of [A-Za-z0-9._:-] "
            f"(got {len(text)} characters)")


def replay_entry_bytes(key: tuple, digest: bytes, body: bytes) -> int:
    """What one replay-cache entry holds, in bytes: its key's texts, digest and answer, plus
    a fixed overhead for the containers."""
    texts = sum(sys.getsizeof(part) for part in key if isinstance(part, str))
    return REPLAY_ENTRY_OVERHEAD + texts + len(digest) + len(body)


def _refuse_constant(text: str) -> NoReturn:
    raise InvalidInputError(f"{text} is not a JSON number the gateway accepts")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidInputError(f"the number {text[:40]} is too large for a float")
    return value


def loads(raw: bytes, what: str) -> JsonValue:
    """The JSON value of a request body, or `InvalidInputError` (see the module docstring)."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise InvalidInputError(f"{what}: the body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{what}: the body is not JSON: {exc}") from None


def bucket(name: str, known: Mapping[str, object]) -> str:
    return name if name in known else UNKNOWN_ACTION


def printable(text: str) -> str:
    """`text` safe for one log line: control characters escaped, at most `LOG_TEXT_CHARS`."""
    short = text[:LOG_TEXT_CHARS]
    escaped = short.encode("unicode_escape", "backslashreplace").decode("ascii")
    return escaped + ("..." if len(text) > LOG_TEXT_CHARS else "")


@functools.lru_cache(maxsize=1024)
def _claims_text(claims: TokenClaims) -> bytes:
    """Every claim of a token, as text (a client sends one token on every request)."""
    return repr(attrs.astuple(claims)).encode("utf-8")


def request_digest(raw: bytes, claims: TokenClaims, extra: str = "") -> bytes:
    """A digest of what makes two requests the same: the body, the token's claims (every
    claim, so a token with other rights or another id is another request) and `extra`
    (headers that change the answer)."""
    digest = hashlib.sha256()
    for part in (_claims_text(claims), extra.encode("utf-8"), raw):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()


@attrs.define(eq=False)
class ReplayCache:
    """Answers of applied writes, bounded by bytes and age (see the module docstring)."""

    max_bytes: int = REPLAY_MAX_BYTES
    ttl_s: float = REPLAY_TTL_S
    _done: "collections.OrderedDict[tuple, tuple[float, bytes, bytes]]" = attrs.field(
        init=False, factory=collections.OrderedDict)
    _running: dict[tuple, tuple[bytes, trio.Event]] = attrs.field(init=False, factory=dict)
    _bytes: int = attrs.field(init=False, default=0)
    hits: int = attrs.field(init=False, default=0)
    mismatches: int = attrs.field(init=False, default=0)

    def _refuse(self, key: tuple) -> ConflictError:
        self.mismatches += 1
        return ConflictError(
            f"{key[2]}: request id {printable(str(key[3]))!r} was already used for another "
            f"request (another body or another token); send a new id for a new request")

    def _lookup(self, key: tuple, digest: bytes) -> bytes | None:
        entry = self._done.get(key)
        if entry is None or entry[0] < trio.current_time():
            return None
        if entry[1] != digest:
            raise self._refuse(key)
        return entry[2]

    def _store(self, key: tuple, digest: bytes, body: bytes) -> None:
        now = trio.current_time()
        old = self._done.pop(key, None)
        if old is not None:
            self._bytes -= replay_entry_bytes(key, old[1], old[2])
        self._done[key] = (now + self.ttl_s, digest, body)
        self._bytes += replay_entry_bytes(key, digest, body)
        while self._done and (self._bytes > self.max_bytes or next(iter(self._done.values()))[0] < now):
            dropped_key, (_, dropped_digest, dropped) = self._done.popitem(last=False)
            self._bytes -= replay_entry_bytes(dropped_key, dropped_digest, dropped)

    async def run(self, key: tuple, digest: bytes, compute: Callable[[], Awaitable[bytes]]) -> bytes:
        """The cached answer for `key` (when `digest` matches), or `await compute()` (stored
        when it returns); `ConflictError` when `key` was used with another digest."""
        while True:
            hit = self._lookup(key, digest)
            if hit is not None:
                self.hits += 1
                return hit
            running = self._running.get(key)
            if running is None:
                break
            if running[0] != digest:
                raise self._refuse(key)
            await running[1].wait()
        done = trio.Event()
        self._running[key] = (digest, done)
        try:
            body = await compute()
            self._store(key, digest, body)
            return body
        finally:
            del self._running[key]
            done.set()


@attrs.define(eq=False)
class RunCheck:
    """Registered runs already seen, by (org, play, run id, epoch) (see the module docstring)."""

    max_entries: int = RUN_CHECK_ENTRIES
    _known: "collections.OrderedDict[tuple, None]" = attrs.field(
        init=False, factory=collections.OrderedDict)
    lookups: int = attrs.field(init=False, default=0)

    async def check(self, port: Port, run: RunRef | RunScope) -> None:
        """Refuse `run` unless it is registered (with its epoch, for a `RunRef`)."""
        scope, epoch = (run.scope, run.epoch) if isinstance(run, RunRef) else (run, None)
        key = (scope.org_id, scope.play, scope.run_id, epoch)
        if key in self._known:
            return
        self.lookups += 1
        info = await runs.get(port, scope)
        if info is None:
            raise ConflictError(
                f"run {printable(scope.run_id)!r} of play {printable(scope.play)!r} is not "
                f"registered; register it (runs.register) before writing for it")
        if epoch is not None and info.epoch != epoch:
            raise ConflictError(
                f"run {printable(scope.run_id)!r} of play {printable(scope.play)!r} holds epoch "
                f"{info.epoch}, not {run.epoch}")
        self.known(RunRef(scope, info.epoch))

    def known(self, ref: RunRef) -> None:
        """Remember that `ref` is registered (a lookup, or `runs.register` answering it): both
        with its epoch and by its scope alone, so neither form is looked up again."""
        scope = ref.scope
        for epoch in (ref.epoch, None):
            self._known[(scope.org_id, scope.play, scope.run_id, epoch)] = None
        while len(self._known) > self.max_entries:
            self._known.popitem(last=False)


def scope_of(kwargs: Mapping[str, object]) -> tuple[str | None, str | None]:
    """The org and play an action's decoded inputs name (None, None for org-wide actions); a
    bare `play` (as `db_sessions.create` takes) is a play of the token's org."""
    for value in kwargs.values():
        if isinstance(value, RunRef):
            value = value.scope
        if isinstance(value, (PlayScope, RunScope, MapScope)):
            return value.org_id, value.play
    play = kwargs.get("play")
    if isinstance(play, str):
        return None, play.strip()
    return None, None


def named_runs(kwargs: Mapping[str, object], writes: bool) -> list[RunRef | RunScope]:
    """The runs an action's decoded inputs name: every `RunRef`, and for a write every run
    named by scope alone (a `RunScope`, or the run of a `MapScope`)."""
    found: list[RunRef | RunScope] = []
    for value in kwargs.values():
        if isinstance(value, RunRef):
            found.append(value)
        elif writes and isinstance(value, (RunScope, MapScope)):
            found.append(RunScope(value.org_id, value.play, value.run_id))
    return found


def named_run_ids(kwargs: Mapping[str, object]) -> list[str]:
    """Every run id an action's decoded inputs name (a `RunRef`, a `RunScope` or `MapScope`'s
    run, a `run_id` argument such as `sheets.read_rows`', each of a `run_ids` list such as
    `history.list_maps`', `outbox.get_many`' and `sheets.run_rows`'), for a token's `runs`
    claim."""
    found = [run.run_id for run in named_runs(kwargs, True)]
    if isinstance(kwargs.get("run_id"), str):
        found.append(kwargs["run_id"])
    listed = kwargs.get("run_ids")
    if isinstance(listed, (list, tuple)):
        found.extend(run_id for run_id in listed if isinstance(run_id, str))
    return found


# An input under which an action also does what another action does: the token's actions
# claim must allow that one too (a claim without `outbox.mark_pending` cannot record a run's
# terminal entry through `retire_entry`).
ALSO_DOES = {("array_input.retire_entry", "record_lease_s"): "outbox.mark_pending"}


def check_also_does(claims: TokenClaims, name: str, kwargs: Mapping[str, object]) -> None:
    """`ScopeError` unless the token allows every action the inputs make `name` do as well."""
    for (action, field), other in ALSO_DOES.items():
        if action == name and kwargs.get(field) is not None:
            claims.check_action(other)
