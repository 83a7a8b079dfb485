"""Observability in the ecosystem's formats (docs/guide/observability.md): Prometheus metrics
(`metrics`, served by `exposition`), JSON log lines (`logs`) carrying the current org, play,
run and map (`context`), and OpenTelemetry traces (`tracing`, with the `otel` extra). The
engine's lowest layer: actors, the gateway, the console and the command line import it; it
imports none of them."""
