"""infra.tracing: off unless the standard OTEL_* variables ask, and a context that crosses
Redis as a string joins the worker's spans to the gateway's trace. Live, on real processes:
tests/test_observability_live.py::test_one_connected_trace_from_gateway_to_worker_without_content.
"""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from infra import tracing


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),
    ({"OTEL_SERVICE_NAME": "gw"}, False),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, False),
])
def test_off_unless_the_environment_asks(env, on):
    assert tracing.wanted(env) is on


def test_nothing_runs_while_off():
    tracing.shutdown()
    assert tracing.start_request("POST /v1/chat/completions", []) is None
    assert tracing.carrier(None) is None and tracing.trace_id(None) is None
    assert tracing.from_carrier(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 1") \
        is None
    with tracing.child(None, "authenticate") as span:
        assert span is None


@pytest.fixture
def exported():
    exporter = InMemorySpanExporter()
    tracing.shutdown()
    assert tracing.setup("test", exporter=exporter, simple=True)
    yield exporter
    tracing.shutdown()


def test_a_context_carried_as_a_string_joins_one_trace(exported):
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    root = tracing.start_request("POST /v1/chat/completions", [(b"traceparent", parent.encode())])
    with tracing.child(root, "admission", pool="p"):
        carried = tracing.carrier(root)
    found = tracing.from_carrier(carried.encode())
    assert found is not None
    ctx, enqueued_ns = found
    assert abs(enqueued_ns - time.time_ns()) < 5e9
    tracing.record(ctx, "queue_wait", enqueued_ns, time.time_ns(), pool="p", tenant__id="7")
    tracing.set_attributes(root, key__prefix="igw_abc", skipped=None)
    root.end()
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert set(spans) == {"POST /v1/chat/completions", "admission", "queue_wait"}
    assert {format(s.context.trace_id, "032x") for s in spans.values()} == {
        "4bf92f3577b34da6a3ce929d0e0e4736"}
    root_id = spans["POST /v1/chat/completions"].context.span_id
    assert spans["queue_wait"].parent.span_id == root_id
    assert spans["admission"].parent.span_id == root_id
    assert dict(spans["queue_wait"].attributes) == {"pool": "p", "tenant.id": "7"}
    assert dict(spans["POST /v1/chat/completions"].attributes) == {"key.prefix": "igw_abc"}
    assert tracing.trace_id(root) == "4bf92f3577b34da6a3ce929d0e0e4736"
