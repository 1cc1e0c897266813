"""Quiet logs (issue 29): an expected refusal is one line without a traceback, a warning that
fires per request is logged once a minute and counted in /metrics."""

from __future__ import annotations

import logging

import pytest
from django.urls import reverse

from infra import quietlog
from metering import metrics
from tenants.auth import clear_cache
from tests.worlds import build_world


@pytest.fixture
def root_records():
    """Everything that reaches the root logger's handlers (what the server log would show)."""
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            self.format(record)  # what a real handler does: renders the traceback, if any
            seen.append(record)

    handler = Keep(level=logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    yield seen
    root.removeHandler(handler)


@pytest.mark.django_db
def test_portal_403_and_404_log_one_line_without_traceback(client, redis_client, root_records):
    clear_cache()
    world = build_world()
    client.force_login(world.users["member"])
    assert client.get(reverse("portal:tokens")).status_code == 403
    assert client.get("/portal/no-such-page/").status_code == 404
    lines = [r for r in root_records if r.name == "django.request"]
    assert [r.status_code for r in lines] == [403, 404]
    assert all(r.exc_info is None and not r.exc_text for r in lines)
    # One handler saw each once: Django's own console handler no longer repeats it.
    assert len(logging.getLogger("django").handlers) <= 1  # mail_admins only
    assert not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                   for h in logging.getLogger("django").handlers)


def test_a_5xx_keeps_its_traceback():
    record = logging.LogRecord("django.request", logging.ERROR, __file__, 1, "boom", (),
                               (ValueError, ValueError("x"), None))
    record.status_code = 500
    assert quietlog.ExpectedRefusals().filter(record)
    assert record.exc_info is not None
    record.status_code = 429
    quietlog.ExpectedRefusals().filter(record)
    assert record.exc_info is None


def test_repeated_warning_logged_once_per_interval_and_counted(caplog, redis_client):
    now = [1000.0]
    log = logging.getLogger("test.repeated")
    repeated = quietlog.Repeated(log, "test_event", every_s=60, clock=lambda: now[0])
    quietlog.take_counts()
    redis_client.delete(quietlog.counts_key())
    with caplog.at_level(logging.WARNING, logger="test.repeated"):
        for i in range(100):
            repeated.warning("usage %s differs", i)
        now[0] += 61
        repeated.warning("usage %s differs", 100)
    lines = [r.getMessage() for r in caplog.records if r.name == "test.repeated"]
    assert lines == ["usage 0 differs", "usage 100 differs (and 99 more like this in the last 60s)"]
    quietlog.flush(redis_client)
    assert int(redis_client.hget(quietlog.counts_key(), "test_event")) == 101
    quietlog.flush(redis_client)  # nothing new: nothing added twice
    assert int(redis_client.hget(quietlog.counts_key(), "test_event")) == 101


@pytest.mark.django_db
def test_repeated_events_are_exported(redis_client):
    redis_client.delete(quietlog.counts_key())
    redis_client.hincrby(quietlog.counts_key(), "upstream_usage_differs", 7)
    text = metrics.render(redis_client)
    assert 'igw_repeated_log_events_total{event="upstream_usage_differs"} 7.0' in text
