"""Fault injection for simulations: a `Port` that delays, fails or cancels at every boundary.

How it works
- A `FaultPlan` is a finite script of `Fault`s, drawn up front by hypothesis (`fault_plans()`),
  so what an actor suffers depends only on the drawn data, never on scheduling. The plan is
  consumed one step per boundary — every connection checkout and every statement (BEGIN and
  COMMIT included) — and injects nothing once exhausted, so each call eventually gets through.
- `FaultyPort(inner, plan)` wraps any port (usually the shared tenant; give each actor its own
  wrapper and plan). At a boundary the step decides:
    `none`        nothing;
    `checkpoint`  a bare trio checkpoint (lets the scheduler interleave other tasks);
    `delay`       `trio.sleep(step.delay)` (a few milliseconds);
    `unavailable` the connection is dropped and `StoreUnavailableError` raised, as when a
                  network cut loses it; at a checkout nothing was sent yet;
    `cancel`      the task's innermost `cancellable()` scope is cancelled, so the checkout or the
                  statement raises `trio.Cancelled` exactly where a caller's cancellation would
                  land (the adapter then discards the connection).
    `lost_reply`  (opt-in, statements only) the statement runs, then the connection is dropped
                  and `StoreUnavailableError` raised: the caller cannot tell whether it applied.
  A fault that falls where it cannot apply — anything at COMMIT/ROLLBACK/RELEASE (they run
  shielded), a lost reply at a checkout — is deferred: that boundary gets a checkpoint and the
  fault applies at the port's next boundary instead (before the next step of the plan), so a
  drawn fault is not silently lost. A cancel with no `cancellable()` scope becomes a checkpoint
  (`neutralized` counts those).
- `injected` counts faults that were applied (delays, errors, cancellations), `by_kind` splits
  them; simulations add these to their report. `drawn` counts the plan's faults of counted
  kinds, `boundaries_met` the boundaries the port saw; `unfired` the drawn faults that never
  applied (the actor finished first, or the fault was neutralized). `harness.unfired` turns a
  port that drew faults but met no boundary at all (it was never wired in) into a violation.

Typical use in a scenario (each hypothesis example in its own `trio.run`):

    plan = data.draw(fault_plans(), label="sealer")
    port = FaultyPort(tenant, plan)
    with port.cancellable() as scope:
        await array_input.seal(port, scope_, ...)
    if scope.cancelled_caught: ...       # the call was cancelled by a fault
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from typing import Iterator, Literal

import attrs
import trio
from hypothesis import strategies as st

from runplane.engine.errors import StoreUnavailableError
from runplane.engine.ports import Port

from .ports import LOSE_REPLY, Boundary, HookedPort

FaultKind = Literal["none", "checkpoint", "delay", "unavailable", "cancel", "lost_reply"]
# The default mix. `lost_reply` is opt-in (pass `kinds=ALL_FAULT_KINDS`): it makes a failed call
# ambiguous (the statement may have taken effect), which a scenario's model must allow for.
FAULT_KINDS: tuple[FaultKind, ...] = ("none", "checkpoint", "delay", "unavailable", "cancel")
ALL_FAULT_KINDS: tuple[FaultKind, ...] = (*FAULT_KINDS, "lost_reply")
# Applied faults (counted); checkpoints only perturb the interleaving.
COUNTED_KINDS = frozenset({"delay", "unavailable", "cancel", "lost_reply"})
MAX_DELAY = 0.02
_UNFAULTABLE_PREFIXES = ("COMMIT", "ROLLBACK", "RELEASE")


@attrs.frozen
class Fault:
    kind: FaultKind = attrs.field(validator=attrs.validators.in_(ALL_FAULT_KINDS))
    delay: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))


NO_FAULT = Fault("none")


@attrs.frozen
class FaultPlan:
    """The faults one actor meets, one step per boundary in order; none after the last step."""

    steps: tuple[Fault, ...] = attrs.field(converter=tuple, factory=tuple)

    @classmethod
    def quiet(cls) -> "FaultPlan":
        return cls(())


def faults(
    kinds: tuple[FaultKind, ...] = FAULT_KINDS, *, weight_none: int = 6
) -> st.SearchStrategy[Fault]:
    """One step: mostly `none` (it shrinks there), else one of `kinds`."""
    active = [kind for kind in kinds if kind != "none"]
    choices = st.sampled_from(("none",) * weight_none + tuple(active)) if active else st.just("none")

    def build(kind: FaultKind, delay_ms: int) -> Fault:
        return Fault(kind, delay_ms / 1000 if kind == "delay" else 0.0)

    return st.builds(build, choices, st.integers(0, int(MAX_DELAY * 1000)))


def fault_plans(
    *, max_steps: int = 24, kinds: tuple[FaultKind, ...] = FAULT_KINDS, weight_none: int = 6
) -> st.SearchStrategy[FaultPlan]:
    """A strategy of plans of at most `max_steps` steps drawn from `kinds`."""
    return st.lists(faults(kinds, weight_none=weight_none), max_size=max_steps).map(FaultPlan)


@attrs.define(eq=False)
class _FaultHook:
    plan: FaultPlan
    position: int = 0
    injected: int = 0
    by_kind: collections.Counter = attrs.field(factory=collections.Counter)
    scopes: dict[trio.lowlevel.Task, list[trio.CancelScope]] = attrs.field(factory=dict)

    neutralized: int = 0
    boundaries_met: int = 0
    deferred: Fault | None = None

    def next_fault(self) -> Fault:
        if self.deferred is not None:
            fault, self.deferred = self.deferred, None
            return fault
        if self.position >= len(self.plan.steps):
            return NO_FAULT
        self.position += 1
        return self.plan.steps[self.position - 1]

    async def at_boundary(self, boundary: Boundary) -> str | None:
        self.boundaries_met += 1
        fault = self.next_fault()
        if fault.kind == "none":
            return None
        sql = (boundary.sql or "").lstrip().upper()
        if (boundary.kind == "query" and sql.startswith(_UNFAULTABLE_PREFIXES)) or (
            boundary.kind == "checkout" and fault.kind == "lost_reply"
        ):
            if fault.kind in COUNTED_KINDS:
                self.deferred = fault  # applies at the next boundary
            await trio.lowlevel.checkpoint()
            return None
        if fault.kind == "lost_reply":
            self._count("lost_reply")
            return LOSE_REPLY
        if fault.kind == "checkpoint":
            await trio.lowlevel.checkpoint()
        elif fault.kind == "delay":
            self._count("delay")
            await trio.sleep(fault.delay)
        elif fault.kind == "unavailable":
            self._count("unavailable")
            raise StoreUnavailableError(f"injected fault: connection lost at {boundary.kind}")
        elif fault.kind == "cancel":
            stack = self.scopes.get(trio.lowlevel.current_task())
            if not stack:
                self.neutralize(fault)
                await trio.lowlevel.checkpoint()
                return None
            self._count("cancel")
            stack[-1].cancel()
            await trio.lowlevel.checkpoint()  # raises Cancelled here, inside the call
        return None

    def neutralize(self, fault: Fault) -> None:
        if fault.kind in COUNTED_KINDS:
            self.neutralized += 1

    def _count(self, kind: str) -> None:
        self.injected += 1
        self.by_kind[kind] += 1


# The fault ports made while `collect_ports()` is active (the harness tallies them per example).
_COLLECTED: contextvars.ContextVar[list | None] = contextvars.ContextVar("fault_ports", default=None)


@contextlib.contextmanager
def collect_ports() -> Iterator[list["FaultyPort"]]:
    """Collect every `FaultyPort` made inside the block (trio.run copies the context, so ports
    made inside a `trio.run` called in the block are collected too)."""
    ports: list[FaultyPort] = []
    token = _COLLECTED.set(ports)
    try:
        yield ports
    finally:
        _COLLECTED.reset(token)


class FaultyPort(HookedPort):
    """A port that applies `plan` at every checkout and statement of `inner`."""

    def __init__(self, inner: Port, plan: FaultPlan) -> None:
        super().__init__(inner, _FaultHook(plan))
        collected = _COLLECTED.get()
        if collected is not None:
            collected.append(self)

    @property
    def injected(self) -> int:
        """Faults applied so far (delays, transient errors, cancellations)."""
        return self.hook.injected

    @property
    def by_kind(self) -> dict[str, int]:
        return dict(self.hook.by_kind)

    @property
    def drawn(self) -> int:
        """Faults of counted kinds in the plan."""
        return sum(1 for step in self.hook.plan.steps if step.kind in COUNTED_KINDS)

    @property
    def boundaries_met(self) -> int:
        return self.hook.boundaries_met

    @property
    def neutralized(self) -> int:
        """Drawn cancels that found no `cancellable()` scope and became checkpoints."""
        return self.hook.neutralized

    @property
    def unfired(self) -> int:
        """Drawn faults that never applied (beyond the actor's last boundary, deferred past it,
        or neutralized)."""
        return self.drawn - self.injected

    @contextlib.contextmanager
    def cancellable(self) -> Iterator[trio.CancelScope]:
        """A cancel scope that `cancel` faults of this port may cancel (for the current task)."""
        task = trio.lowlevel.current_task()
        stack = self.hook.scopes.setdefault(task, [])
        with trio.CancelScope() as scope:
            stack.append(scope)
            try:
                yield scope
            finally:
                stack.remove(scope)
                if not stack:
                    del self.hook.scopes[task]
