"""runplane's Prometheus metrics (docs/guide/observability.md): one registry per process,
bounded labels, cheap updates.

Choices
- One `CollectorRegistry` owned by runplane (`REGISTRY`), not prometheus_client's global one:
  an embedding application's own metrics stay its own, and tests read ours alone.
- Each figure is counted where runplane already counts it, with no store call of its own:
  `MapTally` (rows by outcome, deltas pushed as it reports), `CallGauge` (rows in a call and
  the call's time), `OutageWatch` (outage seconds, when an outage ends), `Permits` (waits that
  blocked), the pg connection's statement choke point, the gateway's dispatch, the console's
  event streams, the shared-map worker's claims (lease takeovers), database sessions minted
  and ended by this process.
- Figures with a hot path (row calls, statements) use `histograms.FastHistogram` and collectors
  that read live state at scrape time (`rows_running` sums the live `CallGauge`s), so a
  100,000-row map pays a bisect and an add per call.
- Labels never carry an org or an error cause (§35). Plays and tables are the process's own, the
  first `PLAY_CAP` (play, table) pairs; later ones are counted under `other`. Actions are the
  registry's names, HTTP codes a fixed set, lanes the tenant's known lanes; anything else is
  `other`. Meanings match §27: `running` is rows inside a call of the function in this process;
  summed over processes it is the figure every surface shows.
"""

from __future__ import annotations

import enum
import heapq
import time
import weakref
from typing import Iterable, Iterator, Protocol

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from .histograms import (CALL_BUCKETS, OTHER, STATEMENT_BUCKETS, WAIT_BUCKETS, BoundedLabels,
                         LabeledHistograms)

PLAY_CAP = 50
LANES = ("sheet", "receipts", "retirement", "console", "connections")
HTTP_CODES = ("200", "204", "400", "401", "403", "404", "405", "409", "410", "413", "415", "422",
              "429", "500", "502", "503", "504")
STATEMENT_KINDS = ("select", "insert", "update", "delete", "with", "begin", "commit", "rollback",
                   "savepoint", "release", "copy", "set", "create", "alter", "drop", "lock")


class RowOutcome(enum.Enum):
    """The `outcome` label of `runplane_rows_total` (what a row came to, §27's words)."""

    COMPLETED = "completed"
    FAILED = "failed"
    CACHED = "cached"
    RETRIED = "retried"   # calls that raised and were called again (this run's)
    FENCED = "fenced"
    SKIPPED = "skipped"


class SharedUnitState(enum.Enum):
    """The `state` label of `runplane_shared_units` (a shared map's units, as its coordinator
    last read them): `open` (free or leased: not done) or `done`."""

    OPEN = "open"
    DONE = "done"


REGISTRY = CollectorRegistry(auto_describe=True)

ROWS = Counter("runplane_rows", "Rows by what they came to, counted by the process that wrote "
               "(completed, failed, fenced), admitted (cached, skipped) or called (retried) them",
               ["play", "table", "outcome"], registry=REGISTRY)
STORE_OUTAGE = Counter("runplane_store_outage_seconds", "Seconds runs waited for the database "
                       "(outages that ended)", registry=REGISTRY)
GATEWAY_REQUESTS = Counter("runplane_gateway_requests", "Gateway action requests answered, by "
                           "action and HTTP status", ["action", "code"], registry=REGISTRY)
GATEWAY_SECONDS = Histogram("runplane_gateway_request_seconds", "Gateway action requests' time, "
                            "by action", ["action"], registry=REGISTRY)
LEASE_TAKEOVERS = Counter("runplane_lease_takeovers", "Shared-map units this process claimed "
                          "after another holder had them (expired or released)",
                          registry=REGISTRY)
CONSOLE_STREAMS = Gauge("runplane_console_streams", "Console live-update streams open",
                        registry=REGISTRY)

ROW_SECONDS = LabeledHistograms("runplane_row_seconds", "Time of the row function's calls",
                                (), CALL_BUCKETS)
STATEMENT_SECONDS = LabeledHistograms("runplane_statement_seconds", "Statements' time, by lane "
                                      "and kind (the statement's first word)", ("lane", "kind"),
                                      STATEMENT_BUCKETS)
PERMIT_WAIT = LabeledHistograms("runplane_permit_wait_seconds", "Waits for a lane permit that "
                                "found none free, by lane", ("lane",), WAIT_BUCKETS)
_CALL_TIME = ROW_SECONDS.child()

_plays = BoundedLabels(PLAY_CAP)
_lanes = BoundedLabels(known=LANES)
_codes = BoundedLabels(known=HTTP_CODES)
_actions = BoundedLabels(known=())
_kinds: dict[str, str] = {}


class InCall(Protocol):
    in_call: int


_gauges: "weakref.WeakSet[InCall]" = weakref.WeakSet()
_shared: dict[str, tuple[int, int]] = {}  # map invocation id -> (units, done), maps in flight
_sessions: list[float] = []  # expiry times (epoch seconds) of sessions minted here, a heap


class _Running:
    """`runplane_rows_running`: the rows inside a call in this process, summed at scrape time."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("runplane_rows_running", "Rows inside a call of the function in "
                                "this process (§27's running)",
                                value=sum(g.in_call for g in list(_gauges)))

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self.collect())


class _Shared:
    """`runplane_shared_units{state}` and `runplane_sessions_live`, read at scrape time."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        units = GaugeMetricFamily("runplane_shared_units", "Units of the shared maps this "
                                  "process coordinates (in flight), by state", labels=["state"])
        figures = list(_shared.values())
        done = sum(d for _, d in figures)
        units.add_metric([SharedUnitState.OPEN.value], sum(u for u, _ in figures) - done)
        units.add_metric([SharedUnitState.DONE.value], done)
        yield units
        now = time.time()
        while _sessions and _sessions[0] <= now:
            heapq.heappop(_sessions)
        yield GaugeMetricFamily("runplane_sessions_live", "Database sessions minted by this "
                                "process and not yet expired (a total: no org label)",
                                value=len(_sessions))

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self.collect())


for _collector in (_Running(), _Shared(), ROW_SECONDS, STATEMENT_SECONDS, PERMIT_WAIT):
    REGISTRY.register(_collector)


def exposition() -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(REGISTRY)


# -- rows --------------------------------------------------------------------------------------
@attrs.define(eq=False)
class RowMeters:
    """The `runplane_rows_total` children of one (play, table), and what was pushed so far."""

    children: dict[RowOutcome, Counter]
    pushed: dict[RowOutcome, int] = attrs.field(factory=lambda: dict.fromkeys(RowOutcome, 0))

    @classmethod
    def of(cls, play: str | None, table: str | None) -> RowMeters:
        pair = _plays(f"{play}\x00{table}") if play and table else OTHER
        play_l, table_l = pair.split("\x00") if pair != OTHER else (OTHER, OTHER)
        return cls({o: ROWS.labels(play_l, table_l, o.value) for o in RowOutcome})

    def push(self, counts: dict[RowOutcome, int]) -> None:
        """Bring the counters up to `counts` (running totals of one map)."""
        pushed = self.pushed
        for outcome, value in counts.items():
            delta = value - pushed[outcome]
            if delta > 0:
                self.children[outcome].inc(delta)
                pushed[outcome] = value

    def add(self, counts: dict[RowOutcome, int]) -> None:
        """Add `counts` (one written batch) to the counters."""
        for outcome, value in counts.items():
            if value > 0:
                self.children[outcome].inc(value)


def track_calls(gauge: InCall) -> None:
    """Count `gauge.in_call` in `runplane_rows_running` while the gauge lives."""
    _gauges.add(gauge)


def call_seconds(seconds: float) -> None:
    _CALL_TIME.observe(seconds)


def _nothing(*_args: object) -> None:
    return None


_HOT = ("call_seconds", "statement_seconds", "permit_waited")


def set_enabled(on: bool) -> None:
    """Turn the per-call and per-statement observations on (the default) or off: the
    benchmark's switch (`benchmarks/metrics_overhead.py`); callers look them up through this
    module, so the swap holds at once. Row counters, gauges and the gateway's are unaffected."""
    for name in _HOT:
        globals()[name] = _HOT_ON[name] if on else _nothing


# -- store -------------------------------------------------------------------------------------
def statement_kind(sql: str) -> str:
    """The first word of `sql`, lower-cased, when it is a known kind; else `other` (cached)."""
    kind = _kinds.get(sql)
    if kind is None:
        word = sql.lstrip().split(None, 1)[0].lower() if sql.strip() else ""
        kind = word if word in STATEMENT_KINDS else OTHER
        if len(_kinds) < 4096:
            _kinds[sql] = kind
    return kind


def statement_seconds(lane: str, sql: str, seconds: float) -> None:
    STATEMENT_SECONDS.child(_lanes(lane), statement_kind(sql)).observe(seconds)


def permit_waited(lane: str, seconds: float) -> None:
    PERMIT_WAIT.child(_lanes(lane)).observe(seconds)


def outage_ended(seconds: float) -> None:
    STORE_OUTAGE.inc(max(0.0, seconds))


# -- gateway, console, shared maps, sessions ---------------------------------------------------
def know_actions(names: Iterable[str]) -> None:
    """The gateway's action names: the values its `action` labels may take (others: `other`)."""
    _actions.known.update(names)


def action_label(action: str) -> str:
    """`action` as the `action` label takes it: a known action's name, else `other`."""
    return _actions(action)


def gateway_request(action: str, code: int, seconds: float) -> None:
    label = _actions(action)
    GATEWAY_REQUESTS.labels(label, _codes(str(code))).inc()
    GATEWAY_SECONDS.labels(label).observe(seconds)


def shared_units(map_invocation_id: str, units: int, done: int, final: bool) -> None:
    """A coordinator read its shared map's units; `final`: the map ended (it stops counting)."""
    if final:
        _shared.pop(map_invocation_id, None)
    else:
        _shared[map_invocation_id] = (units, done)


def session_minted(expires_at: float) -> None:
    """A database session was minted here; it counts as live until `expires_at` (epoch s)."""
    heapq.heappush(_sessions, expires_at)


def lease_takeovers(count: int) -> None:
    if count:
        LEASE_TAKEOVERS.inc(count)


class Timer:
    """`with Timer() as t: ...; t.seconds` — perf_counter around a block."""

    __slots__ = ("started", "seconds")

    def __enter__(self) -> Timer:
        self.started = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *_exc: object) -> None:
        self.seconds = time.perf_counter() - self.started


_HOT_ON = {name: globals()[name] for name in _HOT}  # the observing versions, for `set_enabled`
