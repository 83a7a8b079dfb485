"""Completion diagnostics delivered in the background: a sink never delays or changes a write.

How it works
- Each tenant owns one `DiagnosticsQueue` (`Tenant.diagnostics`) and one task that drains it,
  started when the tenant opens and ended when it closes. `sheets.complete` only appends
  `(sink, diagnostics)` to the queue (`put`, which never waits) and returns; the task calls the
  sink — a plain or an async callable — one item at a time. What a sink raises is logged and
  dropped; it reaches neither the completion nor the task.
- The buffer is bounded (`capacity`, default `DEFAULT_CAPACITY`): when it is full the oldest
  item is dropped and counted (`dropped`), so a slow sink costs memory for at most that many
  items and never backpressures a map.
- At close the task delivers what is buffered, for at most `DRAIN_DEADLINE_S`; what is left then,
  and anything put after close, is dropped and counted.
- The task is a trio system task, not a child of a nursery around the tenant's body: the
  tenant's block keeps raising its own errors unwrapped, and a failing sink cannot cancel it.
- `log_diagnostics` is what a completion with no sink does: one JSON line at DEBUG on the
  `runplane.sheets.diagnostics` logger (built only when DEBUG is enabled).
"""

from __future__ import annotations

import collections
import inspect
import json
import logging
from typing import TYPE_CHECKING, Callable

import attrs
import trio

from .limits.bounds import is_int

if TYPE_CHECKING:
    from .sheets.model import CompletionDiagnostics

log = logging.getLogger("runplane.sheets")
line_log = logging.getLogger("runplane.sheets.diagnostics")

DEFAULT_CAPACITY = 1024
DRAIN_DEADLINE_S = 5.0

# A plain or async callable; what it returns is awaited when awaitable, else dropped.
Sink = Callable[["CompletionDiagnostics"], object]


async def call_sink(sink: Sink, diagnostics: CompletionDiagnostics) -> None:
    """Call a plain or async sink; what it raises is logged, never raised."""
    try:
        result = sink(diagnostics)
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("sheet completion diagnostics sink failed; the result is unaffected")


def log_diagnostics(diagnostics: CompletionDiagnostics) -> None:
    """One JSON line per completion at DEBUG (when no sink was given)."""
    if line_log.isEnabledFor(logging.DEBUG):
        line_log.debug("%s", json.dumps(attrs.asdict(diagnostics), sort_keys=True,
                                        separators=(",", ":")))


@attrs.define(eq=False)
class DiagnosticsQueue:
    """A bounded buffer of diagnostics for sinks, drained by the task `open` starts."""

    capacity: int = DEFAULT_CAPACITY
    dropped: int = 0
    delivered: int = 0
    _items: collections.deque[tuple[Sink, CompletionDiagnostics]] = attrs.field(
        init=False, factory=collections.deque)
    _wake: trio.Event = attrs.field(init=False, factory=trio.Event)
    _idle: trio.Event = attrs.field(init=False, factory=trio.Event)
    _ended: trio.Event = attrs.field(init=False, factory=trio.Event)
    _closing: bool = attrs.field(init=False, default=False)
    _running: bool = attrs.field(init=False, default=False)
    _scope: trio.CancelScope = attrs.field(init=False, factory=trio.CancelScope)

    def __attrs_post_init__(self) -> None:
        if not is_int(self.capacity, 1):
            raise ValueError(f"capacity must be a positive integer, got {self.capacity!r}")
        self._idle.set()

    @property
    def running(self) -> bool:
        """Whether a task drains the queue (between `open` and the end of `close`)."""
        return self._running

    def put(self, sink: Sink, diagnostics: CompletionDiagnostics) -> None:
        """Queue one delivery; never waits (the oldest item is dropped when full, and anything
        put once the queue is closing)."""
        if self._closing or not self._running:
            self.dropped += 1
            return
        if len(self._items) >= self.capacity:
            self._items.popleft()
            self.dropped += 1
        self._items.append((sink, diagnostics))
        if self._idle.is_set():
            self._idle = trio.Event()
        self._wake.set()

    def open(self) -> None:
        """Start the draining task (a trio system task, see the module docstring)."""
        self._running = True
        trio.lowlevel.spawn_system_task(self._drain, name="runplane diagnostics")

    async def _drain(self) -> None:
        try:
            with self._scope:
                await self._deliver()
        finally:
            self.dropped += len(self._items)
            self._items.clear()
            self._idle.set()
            self._ended.set()

    async def _deliver(self) -> None:
        while True:
            while self._items:
                sink, diagnostics = self._items.popleft()
                await call_sink(sink, diagnostics)
                self.delivered += 1
            self._idle.set()
            if self._closing:
                return
            self._wake = trio.Event()
            if not self._items:
                await self._wake.wait()

    async def wait_idle(self) -> None:
        """Wait until everything queued so far was handed to its sink."""
        await self._idle.wait()

    async def close(self) -> None:
        """Deliver what is buffered (for at most `DRAIN_DEADLINE_S`), then end the task."""
        if not self._running:
            return
        self._closing = True
        self._wake.set()
        with trio.CancelScope(shield=True):
            with trio.move_on_after(DRAIN_DEADLINE_S):
                await self._ended.wait()
            self._scope.cancel()  # a sink still running past the deadline is cancelled
            await self._ended.wait()
        self._running = False
