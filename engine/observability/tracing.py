"""OpenTelemetry traces (docs/guide/observability.md, the `otel` extra): spans for a run, a
map, each admission and completion batch, each gateway action on both sides, and a sample of
row calls.

Choices
- Decided once per process (`decide`, at the first run, map, batch or gateway action):
  tracing is on when the `opentelemetry` packages import and the
  standard variables ask for traces — `OTEL_TRACES_EXPORTER` set to an exporter other than
  `none`, or an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_
  ENDPOINT`; the exporter is then `otlp`) — and `OTEL_SDK_DISABLED` is not `true`. runplane
  then builds an SDK `TracerProvider` (resource from `OTEL_SERVICE_NAME` /
  `OTEL_RESOURCE_ATTRIBUTES`, default service name `runplane`; sampler from
  `OTEL_TRACES_SAMPLER`), one `BatchSpanProcessor` (`OTEL_BSP_*`) per exporter named (resolved
  through the `opentelemetry_traces_exporter` entry points the installed packages register:
  `console` comes with the SDK, `otlp` with `opentelemetry-exporter-otlp`), and installs it as
  the global provider unless one is set. Without those variables nothing of OpenTelemetry is
  imported. `configure(provider)` sets a provider explicitly (tests, benchmarks, an application
  that set OpenTelemetry up itself); `configure(None)` turns tracing off.
- Off, a hook costs one attribute check: `ON` (and, once, `_decided`: runs, maps, batches,
  actions get a shared no-op context manager) or `ROWS` (rows: `actors.workers` checks it
  before anything else; a map's rows come after its first batch decided).
- Row calls are sampled per row, `RUNPLANE_TRACE_ROWS_RATIO` of them (default 1 %, 0 for none,
  1 for all; anything else is `InvalidInputError`), by one `random()` before a span is made; a
  sampled row's span is a child of its map's.
- Spans follow trio's tasks through `contextvars`: a span is made current only inside the task
  that made it (`start_as_current_span`, ended and detached on exit), and a task inherits the
  span current where it was started, so the actors a map starts are its children and no span
  leaks into an unrelated task. The run's span is attached by `enter_run` and detached by
  `leave` in the same task (`actors.run.open_run`'s enter and exit).
- Gateway actions: the client makes a CLIENT span per operation (its retries included) and puts
  W3C `traceparent` (the global propagator: `OTEL_PROPAGATORS`, default tracecontext and
  baggage) in the request's headers; the server extracts it and makes a SERVER span per
  request, child of the client's, with the action (known names, else `other`) and the status.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import random
from importlib import metadata
from typing import TYPE_CHECKING, Awaitable, Callable, ContextManager, Iterable, Iterator, TypeVar

import attrs

from ..errors import InvalidInputError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("runplane.tracing")

RATIO_ENV = "RUNPLANE_TRACE_ROWS_RATIO"
DEFAULT_ROW_RATIO = 0.01
DEFAULT_SERVICE = "runplane"
PROPAGATED = frozenset({"traceparent", "tracestate", "baggage"})
EXPORTER_GROUP = "opentelemetry_traces_exporter"
T = TypeVar("T")


class SpanName(enum.Enum):
    RUN = "runplane.run"
    MAP = "runplane.map"
    ADMISSION = "runplane.admission"
    COMPLETION = "runplane.completion"
    ROW = "runplane.row"
    CLIENT = "runplane.gateway.client"
    SERVER = "runplane.gateway.server"


ON = False    # spans are made
ROWS = False  # row calls are sampled (ON, and a ratio above 0)
_ratio = DEFAULT_ROW_RATIO
_tracer: Tracer | None = None
_decided = False
_NULL = contextlib.nullcontext()


def wanted(env: dict[str, str] | os._Environ[str]) -> bool:
    """Whether the `OTEL_*` variables in `env` ask for traces (see the module docstring)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or
                env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def row_ratio(env: dict[str, str] | os._Environ[str]) -> float:
    """`RUNPLANE_TRACE_ROWS_RATIO` as a float in [0, 1] (default 1 %)."""
    text = env.get(RATIO_ENV, "").strip()
    if not text:
        return DEFAULT_ROW_RATIO
    try:
        ratio = float(text)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise InvalidInputError(f"{RATIO_ENV} must be a number from 0 to 1, got {text!r}")
    return ratio


def decide() -> bool:
    """Whether tracing is on, decided at the first call (see the module docstring)."""
    global _decided
    if _decided:
        return ON
    if not wanted(os.environ):
        _decided = True
        return False
    ratio = row_ratio(os.environ)  # a bad ratio is refused before the run's first write
    _decided = True
    try:
        provider = provider_from_env()
    except ImportError as exc:
        log.warning("OTEL_* variables ask for traces but %s: install runplane[otel]", exc)
        return False
    if provider is not None:
        from opentelemetry import trace

        if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):  # none set
            trace.set_tracer_provider(provider)
        configure(provider, ratio)
    return ON


def provider_from_env() -> TracerProvider | None:
    """An SDK provider with a `BatchSpanProcessor` per exporter `OTEL_TRACES_EXPORTER` names;
    None (and a warning) when none of them is installed."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE}))
    provider = TracerProvider(resource=resource)
    names = os.environ.get("OTEL_TRACES_EXPORTER", "").strip() or "otlp"
    added = 0
    for name in (n.strip() for n in names.split(",") if n.strip()):
        found = metadata.entry_points(group=EXPORTER_GROUP, name=name)
        if not found:
            log.warning("OTEL_TRACES_EXPORTER names %r, which no installed package provides "
                        "(otlp: pip install opentelemetry-exporter-otlp)", name)
            continue
        exporter_class = next(iter(found)).load()
        provider.add_span_processor(BatchSpanProcessor(exporter_class()))
        added += 1
    return provider if added else None


def configure(provider: TracerProvider | None, ratio: float | None = None) -> None:
    """Trace into `provider` from now on (None: tracing off), row calls sampled at `ratio`
    (default: `RUNPLANE_TRACE_ROWS_RATIO`). Overrides `decide`."""
    global ON, ROWS, _ratio, _tracer, _decided
    _decided = True
    _ratio = row_ratio(os.environ) if ratio is None else ratio
    if provider is None:
        ON = ROWS = False
        _tracer = None
        return
    _tracer = provider.get_tracer("runplane")
    ON = True
    ROWS = _ratio > 0.0


# -- runs, maps, batches -----------------------------------------------------------------------
@attrs.define(eq=False)
class Held:
    """The run's span while its block runs (span None: tracing off); `error`: what ended it."""

    span: Span | None = None
    token: object = None
    error: BaseException | None = None


def enter_run(org: str, play: str, run_id: str) -> Held:
    """Start the run's span and make it current in this task until `leave`."""
    if not decide():
        return Held()
    from opentelemetry import context, trace

    assert _tracer is not None
    span = _tracer.start_span(SpanName.RUN.value, attributes={
        "runplane.org": org, "runplane.play": play, "runplane.run_id": run_id})
    return Held(span, context.attach(trace.set_span_in_context(span)))


def leave(held: Held) -> None:
    """End the run's span (an error recorded when `held.error` is set) and detach it."""
    if held.span is None:
        return
    from opentelemetry import context

    if held.error is not None:
        _failed(held.span, held.error)
    held.span.end()
    context.detach(held.token)  # type: ignore[arg-type]


def _failed(span: Span, error: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))


def span(name: SpanName, **attributes: str | int | bool) -> ContextManager[object]:
    """A current span named `name` for the block (a no-op when tracing is off); the attributes
    are prefixed `runplane.`."""
    if not (ON or (not _decided and decide())):
        return _NULL
    assert _tracer is not None
    return _tracer.start_as_current_span(
        name.value, attributes={f"runplane.{k}": v for k, v in attributes.items()})


def mapped(table: str) -> ContextManager[object]:
    """The span of one map into `table` (as the caller named it)."""
    if not (ON or (not _decided and decide())):
        return _NULL
    return span(SpanName.MAP, table=table)


def batch(name: SpanName, rows: int) -> ContextManager[object]:
    """The span of one admission or completion batch of `rows` rows."""
    if not (ON or (not _decided and decide())):
        return _NULL
    return span(name, rows=rows)


# -- rows --------------------------------------------------------------------------------------
def sampled() -> bool:
    """Whether this row call gets a span (call only when `ROWS`)."""
    return random.random() < _ratio


async def row_call(call: Awaitable[tuple[T, BaseException | None]], key: str,
                   calls: int) -> tuple[T, BaseException | None]:
    """Await a row's call (its outcome and the exception it raised) inside a row span."""
    assert _tracer is not None
    with _tracer.start_as_current_span(SpanName.ROW.value, attributes={
            "runplane.row.key": key, "runplane.row.calls": calls}) as row_span:
        outcome, error = await call
        if error is not None:
            _failed(row_span, error)
        return outcome, error


# -- gateway actions ---------------------------------------------------------------------------
def client_action(action: str, headers: dict[str, str]) -> ContextManager[object]:
    """The client's span of one action (retries included); puts `traceparent` in `headers`."""
    if not (ON or (not _decided and decide())):
        return _NULL
    return _client_span(action, headers)


@contextlib.contextmanager
def _client_span(action: str, headers: dict[str, str]) -> Iterator[Span]:
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    assert _tracer is not None
    with _tracer.start_as_current_span(SpanName.CLIENT.value, kind=SpanKind.CLIENT,
                                       attributes={"runplane.action": action}) as client_span:
        propagate.inject(headers)
        yield client_span


Headers = Iterable[tuple[str, str]]
Respond = Callable[[str, Headers, T], Awaitable[tuple[int, bytes]]]


async def served(action: str, headers: Headers, respond: Respond[T],
                 receive: T) -> tuple[int, bytes]:
    """`respond(action, headers, receive)` inside the server's span of the request, a child of
    the client's span its `traceparent` names; `action` is labelled as the metrics label it."""
    if not (ON or (not _decided and decide())):
        return await respond(action, headers, receive)
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind, Status, StatusCode

    from .metrics import action_label

    assert _tracer is not None
    headers = list(headers)
    carrier = {k.lower(): v for k, v in headers if k.lower() in PROPAGATED}
    with _tracer.start_as_current_span(
            SpanName.SERVER.value, context=propagate.extract(carrier), kind=SpanKind.SERVER,
            attributes={"runplane.action": action_label(action)}) as server_span:
        status, body = await respond(action, headers, receive)
        server_span.set_attribute("http.response.status_code", status)
        if status >= 500:
            server_span.set_status(Status(StatusCode.ERROR))
        return status, body
