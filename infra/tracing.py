"""OpenTelemetry traces with the official SDK, configured by the standard ``OTEL_*`` variables.

Off unless the environment asks for it: ``OTEL_TRACES_EXPORTER`` set to an exporter
(``otlp``, ``console``), or an OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) with no exporter named. ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` keeps it off. Everything else is the SDK's own reading of the
standard variables: ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (the resource),
``OTEL_TRACES_SAMPLER(_ARG)`` (the sampler), ``OTEL_EXPORTER_OTLP_*`` (endpoint, headers,
protocol: http/protobuf), ``OTEL_BSP_*`` (the batch processor). While off, every helper here
returns at once and nothing of the SDK runs on the request path.

One trace per request, across processes (docs/adr "traces across Redis"):
gateway ``request`` span (the client's W3C ``traceparent`` as its parent, if sent) ->
``authenticate``, ``admission``; the request's Redis hash carries the W3C traceparent and the
enqueue time (``carrier``) to the worker, whose spans (``queue_wait``, ``dispatch``,
``engine.prefill``, ``engine.decode``, ``settlement``) join the same trace. Spans carry ids,
names, counts and codes; never prompt or completion text.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_state: dict[str, Any] = {"enabled": False, "tracer": None, "provider": None}


def wanted(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment turns tracing on (see the module docstring)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup(service_name: str, *, exporter: Any = None, simple: bool = False) -> bool:
    """Install the SDK's tracer provider for this process if the environment wants traces.

    ``exporter``: an explicit span exporter (tests pass the SDK's in-memory one) that turns
    tracing on whatever the environment says. Idempotent; returns whether tracing is on.
    """
    if _state["enabled"] or (exporter is None and not wanted()):
        return bool(_state["enabled"])
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    # OTEL_SERVICE_NAME, when set, names the service (Resource.create reads it).
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    for exp in [exporter] if exporter is not None else _exporters():
        provider.add_span_processor(SimpleSpanProcessor(exp) if simple
                                    else BatchSpanProcessor(exp))
    _state.update(enabled=True, provider=provider,
                  tracer=provider.get_tracer("inference-gateway"))
    return True


def _exporters() -> list[Any]:
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    found: list[Any] = []
    for name in names:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            found.append(OTLPSpanExporter())
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter
            found.append(ConsoleSpanExporter())
        else:
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported here (otlp, console)", name)
    return found


def shutdown() -> None:
    """Flush and stop (tests, process exit); tracing is off afterwards."""
    provider = _state["provider"]
    if provider is not None:
        provider.shutdown()
    _state.update(enabled=False, provider=None, tracer=None)


def enabled() -> bool:
    return bool(_state["enabled"])


def tracer() -> Tracer:
    found = _state["tracer"]
    return found if found is not None else trace.get_tracer("inference-gateway")


# -- the gateway side ---------------------------------------------------------------------------


def parent_from_headers(headers: Sequence[tuple[bytes, bytes]]) -> otel_context.Context | None:
    """The client's W3C trace context (``traceparent``/``tracestate``), if it sent one."""
    carrier = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers
               if k.lower() in (b"traceparent", b"tracestate")}
    return _PROPAGATOR.extract(carrier) if carrier else None


def start_request(name: str, headers: Sequence[tuple[bytes, bytes]]) -> Span | None:
    """The request's root span in this process (not made current: see ``use``); None if off."""
    if not _state["enabled"]:
        return None
    return tracer().start_span(name, context=parent_from_headers(headers), kind=SpanKind.SERVER)


@contextmanager
def child(parent: Span | None, name: str, **attributes: Any) -> Iterator[Span | None]:
    """A child span of ``parent`` around the block; nothing at all when tracing is off."""
    if parent is None:
        yield None
        return
    span = tracer().start_span(name, context=trace.set_span_in_context(parent),
                               attributes=_clean(attributes))
    try:
        yield span
    except BaseException as exc:
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        span.end()


def carrier(span: Span | None) -> str | None:
    """What the request's Redis hash carries to the worker: ``<traceparent> <enqueued ns>``."""
    if span is None:
        return None
    headers: dict[str, str] = {}
    _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
    parent = headers.get("traceparent")
    return f"{parent} {time.time_ns()}" if parent else None


def trace_id(span: Span | None) -> str | None:
    if span is None:
        return None
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def set_attributes(span: Span | None, **attributes: Any) -> None:
    if span is not None:
        span.set_attributes(_clean(attributes))


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k.replace("__", "."): v for k, v in attributes.items() if v is not None}


# -- the worker side ----------------------------------------------------------------------------


def from_carrier(value: bytes | str | None) -> tuple[otel_context.Context, int] | None:
    """(the gateway's context, enqueue time in ns) from a request's carrier; None if none."""
    if not _state["enabled"] or not value:
        return None
    text = value.decode() if isinstance(value, bytes) else value
    parent, _, enqueued = text.partition(" ")
    ctx = _PROPAGATOR.extract({"traceparent": parent})
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx, int(enqueued) if enqueued.isdigit() else time.time_ns()


def record(ctx: otel_context.Context, name: str, start_ns: int, end_ns: int,
           *, error: str | None = None, **attributes: Any) -> None:
    """A finished span with known start and end times (work measured before it was traced)."""
    span = tracer().start_span(name, context=ctx, start_time=start_ns,
                               attributes=_clean(attributes))
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=max(start_ns, end_ns))
