"""Hostile clients against the real processes: huge and slow bodies, slow headers, many streams,
a stolen key trying to spend the tenant's budget, and timing probes of authentication.

The gateway runs with short deadlines (``BODY_READ_TIMEOUT_S``, ``HEADER_READ_TIMEOUT_S``) so
the slow-loris cases take seconds. Raw sockets are used where an HTTP client would be too polite.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from django.utils import timezone

from infra.redis_conn import key
from tests import procs, rkeys
from tests.factories import make_key, make_tenant
from tests.live_pool import (
    HELLO,
    MODEL,
    SERVER_ENV,
    counters,
    ensure_pools,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

MAX_BYTES = int(SERVER_ENV["MAX_REQUEST_BYTES"])
BODY_S = 1.5
HEADER_S = 1.5
ENV = {**SERVER_ENV, "BODY_READ_TIMEOUT_S": str(BODY_S), "HEADER_READ_TIMEOUT_S": str(HEADER_S)}
CHAT = "/v1/chat/completions"
API = "/api/tenants/acme/keys/"


@pytest.fixture(scope="module")
def system(live_system) -> dict[str, Any]:
    return live_system(pool="live-pool", worker_ids=["hostile-w1"], env=ENV,
                       prepare=ensure_pools)


@pytest.fixture
def live(system, redis_client) -> dict[str, Any]:
    ensure_pools()
    procs.wait_for_worker(redis_client, "live-pool", "hostile-w1", system["worker"], timeout=10)
    return system


def _connect(live: dict[str, Any]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", live["port"]), timeout=10)
    sock.settimeout(10)
    return sock


def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: gateway", *(f"{k}: {v}" for k, v in
                                                             headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (or 10 s pass)."""
    out = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            out += chunk
    return out


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Trickle ``trickle`` a byte at a time until the server closes; when it did, or None."""
    start = time.monotonic()
    sock.settimeout(0.25)
    i = 0
    while time.monotonic() - start < seconds:
        try:
            if trickle:
                sock.send(trickle[i % len(trickle):i % len(trickle) + 1])
                i += 1
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    return None


def _free(redis_client) -> None:
    assert not redis_client.keys(key("req", "*")) and not redis_client.keys(key("bucket", "*"))
    assert not rkeys.usage_records(redis_client)


# -- huge bodies -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, API])
def test_a_chunked_body_without_content_length_is_cut_at_the_limit(live, redis_client,
                                                                  path: str) -> None:
    _, plain = make_key(make_tenant())
    sock = _connect(live)
    sock.sendall(_head("POST", path, {"Authorization": f"Bearer {plain}",
                                      "Content-Type": "application/json",
                                      "Transfer-Encoding": "chunked"}))
    chunk = b"x" * 8192
    sent = 0
    with contextlib.suppress(OSError):  # the server may answer and close while we still send
        while sent < 4 * MAX_BYTES:
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
    reply = _response(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"code": "request_too_large"' in reply
    _free(redis_client)


@pytest.mark.parametrize("path", [CHAT, API])
def test_a_declared_huge_body_is_refused_before_it_is_read(live, path: str) -> None:
    sock = _connect(live)
    sock.sendall(_head("POST", path, {"Content-Length": str(10**12),
                                      "Content-Type": "application/json"}))
    reply = sock.recv(65536)  # answered without sending one byte of body
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


# -- slow loris ------------------------------------------------------------------------------


def _read_rest(sock: socket.socket, timeout: float = 2.0) -> bytes:
    """Whatever the server still sends until it closes the connection (or goes quiet)."""
    sock.settimeout(timeout)
    rest = b""
    with contextlib.suppress(TimeoutError, OSError):
        while chunk := sock.recv(65536):
            rest += chunk
    return rest


@pytest.mark.parametrize("path", [CHAT, API])
def test_a_trickled_body_gets_408_at_the_deadline(live, redis_client, path: str) -> None:
    _, plain = make_key(make_tenant())
    sock = _connect(live)
    sock.sendall(_head("POST", path, {"Authorization": f"Bearer {plain}",
                                      "Content-Type": "application/json",
                                      "Content-Length": "1000"}) + b'{"model": ')
    start = time.monotonic()
    answered = b""
    sock.settimeout(0.2)
    while time.monotonic() - start < BODY_S + 5 and not answered:
        with contextlib.suppress(OSError):
            sock.send(b" ")  # one byte every 0.2 s: never done, never idle
        with contextlib.suppress(TimeoutError, OSError):
            answered = sock.recv(65536)
    elapsed = time.monotonic() - start
    answered += _read_rest(sock)  # the body may come in a later segment than the head
    sock.close()
    assert answered.startswith(b"HTTP/1.1 408"), answered[:200]
    assert b"request_timeout" in answered
    assert BODY_S - 0.2 <= elapsed <= BODY_S + 2.5
    _free(redis_client)


def test_trickled_headers_are_cut_off_at_the_deadline(live) -> None:
    sock = _connect(live)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n")
    closed = _closed_within(sock, HEADER_S + 5, trickle=b"X-Slow: a\r\n")
    sock.close()
    assert closed is not None and HEADER_S - 0.2 <= closed <= HEADER_S + 2.5


def test_a_silent_connection_is_closed_at_the_header_deadline(live) -> None:
    sock = _connect(live)
    closed = _closed_within(sock, HEADER_S + 5)
    sock.close()
    assert closed is not None and closed <= HEADER_S + 2.5


def test_keep_alive_then_trickled_next_request_is_cut_off(live) -> None:
    sock = _connect(live)
    sock.sendall(_head("GET", "/v1/openapi.json", {}))
    first = b""
    while b"\r\n\r\n" not in first:
        first += sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    # The next request's first byte cancels uvicorn's keep-alive timer: ours keeps running.
    closed = _closed_within(sock, HEADER_S + 5, trickle=b"GET /v1/models HTTP/1.1\r\n")
    sock.close()
    assert closed is not None and closed <= HEADER_S + 2.5


def test_slow_but_honest_requests_still_work(live) -> None:
    """A streamed body that finishes within the deadline is served normally."""
    _, plain = make_key(make_tenant())
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}' % (
        MODEL.encode())

    def slowly() -> Iterator[bytes]:
        for i in range(0, len(body), 20):
            time.sleep(BODY_S / 10)
            yield body[i:i + 20]

    r = httpx.post(live["url"] + CHAT, content=slowly(), timeout=30,
                   headers={"Authorization": f"Bearer {plain}",
                            "Content-Type": "application/json"})
    assert r.status_code == 200, r.text


# -- many streams ----------------------------------------------------------------------------


def _open_stream(url: str, plain: str, out: list[Any], ready: threading.Event,
                 release: threading.Event) -> None:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + CHAT, json=body, timeout=30,
                      headers={"Authorization": f"Bearer {plain}"}) as resp:
        out.append(resp.status_code)
        ready.set()
        if resp.status_code == 200:
            for _ in resp.iter_lines():
                if release.is_set():
                    break


def test_many_streams_hit_the_open_stream_limit_and_cost_nothing(live, redis_client) -> None:
    tenant = make_tenant(open_streams=10, concurrent_requests=50)
    api_key, plain = make_key(tenant, open_streams=2)  # the key's own cap is lower
    _, sibling = make_key(tenant)
    release = threading.Event()
    statuses: list[int] = []
    threads = []
    for _ in range(2):
        ready = threading.Event()
        t = threading.Thread(target=_open_stream, args=(live["url"], plain, statuses, ready,
                                                        release))
        t.start()
        ready.wait(10)
        threads.append(t)
    try:
        assert statuses == [200, 200]
        before = counters(redis_client, api_key)
        assert before["streams_k"] == 2
        refused = []
        for _ in range(5):  # a client hammering for more streams
            r = httpx.post(live["url"] + CHAT, timeout=10, headers={
                "Authorization": f"Bearer {plain}"}, json={
                "model": MODEL, "messages": HELLO, "max_tokens": 5, "stream": True})
            refused.append(r)
        assert [r.status_code for r in refused] == [429] * 5
        assert all("open streams" in r.json()["error"]["message"] for r in refused)
        assert counters(redis_client, api_key) == before  # refusals took no slot
        # The tenant's other key is not held hostage by this one.
        ok = httpx.post(live["url"] + CHAT, timeout=30, headers={
            "Authorization": f"Bearer {sibling}"}, json={
            "model": MODEL, "messages": HELLO, "max_tokens": 2, "stream": True})
        assert ok.status_code == 200
    finally:
        release.set()
        for t in threads:
            t.join(20)
    procs.wait_until(lambda: counters(redis_client, api_key)["streams_k"] == 0, 10,
                     "streams released")
    from metering.metrics import rejected_key

    rejected = redis_client.hget(rejected_key(), f"{tenant.pk}|{MODEL}|open_streams")
    assert int(rejected or 0) == 5  # counted under their reason for /metrics


# -- denial of wallet ------------------------------------------------------------------------


def _spend(url: str, plain: str, max_tokens: int, limit: int = 40) -> tuple[int, list[str]]:
    """Spend output tokens until refused; (tokens delivered, request ids)."""
    delivered, rids = 0, []
    for _ in range(limit):
        r = httpx.post(url + CHAT, timeout=30, headers={"Authorization": f"Bearer {plain}"},
                       json={"model": MODEL, "messages": HELLO, "max_tokens": max_tokens,
                             "ignore_eos": True})
        if r.status_code == 429:
            return delivered, rids
        assert r.status_code == 200, r.text
        delivered += r.json()["usage"]["completion_tokens"]
        rids.append(r.headers["x-request-id"])
    raise AssertionError(f"never refused after {limit} requests")


def test_a_stolen_key_cannot_spend_more_than_its_cap(live, redis_client) -> None:
    tenant = make_tenant(output_tpm=6000, output_burst=6000)
    cap = 300  # tokens a minute, and its burst: 5 % of the tenant's
    stolen, plain = make_key(tenant, output_tpm=cap, max_output_tokens=50)
    _, honest = make_key(tenant)
    start = time.monotonic()
    delivered, _ = _spend(live["url"], plain, 50)
    refill = cap * (time.monotonic() - start) / 60
    assert cap - 50 < delivered <= cap + refill + 1
    # max_tokens above the key's cap is refused outright; none given means the cap.
    r = httpx.post(live["url"] + CHAT, timeout=30, headers={"Authorization": f"Bearer {plain}"},
                   json={"model": MODEL, "messages": HELLO, "max_tokens": 51})
    assert r.status_code == 400 and r.json()["error"]["code"] == "max_tokens_exceeded"
    # The rest of the tenant's budget is still there for its other keys.
    tenant_out = float(redis_client.hget(rkeys.tenant_bucket(tenant.pk, "out"), "level"))
    assert tenant_out >= 6000 - delivered - 1
    r = httpx.post(live["url"] + CHAT, timeout=30, headers={"Authorization": f"Bearer {honest}"},
                   json={"model": MODEL, "messages": HELLO, "max_tokens": 200,
                         "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200
    assert counters(redis_client, stolen)["conc_k"] == 0


def test_a_spend_alert_on_a_key_fires_and_its_hard_cap_stops_only_that_key(live, redis_client):
    from metering import writer
    from metering.billing import alerts
    from metering.billing.models import AlertEvent, SpendAlert
    from metering.rollups import rollup_hour

    tenant = make_tenant()
    stolen, plain = make_key(tenant)
    _, honest = make_key(tenant)
    alert = SpendAlert.objects.create(tenant=tenant, api_key=stolen, metric="tokens",
                                      period="day", threshold=Decimal(100), hard_cap=True)
    for _ in range(3):
        r = httpx.post(live["url"] + CHAT, timeout=30, headers={
            "Authorization": f"Bearer {plain}"}, json={
            "model": MODEL, "messages": HELLO, "max_tokens": 40, "ignore_eos": True})
        assert r.status_code == 200
        rkeys.wait_usage_record(redis_client, r.headers["x-request-id"])
    writer.flush()
    now = timezone.now()
    rollup_hour(now.replace(minute=0, second=0, microsecond=0))
    [event] = alerts.check_all(now + timedelta(seconds=1))
    assert event.alert_id == alert.pk and event.suspended and event.value >= 120
    assert AlertEvent.objects.filter(alert__tenant=tenant).count() == 1

    def refused() -> bool:
        r = httpx.post(live["url"] + CHAT, timeout=30, headers={
            "Authorization": f"Bearer {plain}"}, json={
            "model": MODEL, "messages": HELLO, "max_tokens": 1})
        # Over budget reads as what it is: 429 insufficient_quota, never 401 "expired".
        return r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"

    procs.wait_until(refused, 5, "the over-budget key to be refused by the running gateway")
    assert httpx.get(live["url"] + "/v1/models", timeout=10, headers={
        "Authorization": f"Bearer {honest}"}).status_code == 200


# -- timing ----------------------------------------------------------------------------------


def test_unknown_and_wrong_keys_take_the_same_time(live) -> None:
    """Medians over many HTTP requests: a key that exists with a wrong secret part must not be
    distinguishable from one that never existed (loose bound: the machine is shared)."""
    from tenants.api_keys import BODY_LEN, DISPLAY_BODY_CHARS, checksum

    real_key, plain = make_key(make_tenant())
    prefix, body, _ = plain.split("_")
    # Both well formed (valid checksum): one shares the real key's shown prefix, one nothing.
    wrong_body = body[:DISPLAY_BODY_CHARS] + "A" * (BODY_LEN - DISPLAY_BODY_CHARS)
    wrong_secret = f"{prefix}_{wrong_body}_{checksum(wrong_body)}"
    unknown = f"{prefix}_{'B' * BODY_LEN}_{checksum('B' * BODY_LEN)}"
    url = live["url"] + "/v1/models"

    def elapsed_ms(token: str, client: httpx.Client) -> float:
        t0 = time.perf_counter()
        r = client.get(url, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 401
        return (time.perf_counter() - t0) * 1000

    # The two kinds interleaved (ABBA), so both meet the same load: the live lane's other
    # workers load the machine in bursts, and blocks of one kind after the other compared the
    # bursts, not the keys (a block's median once differed by 1.85 ms of 6).
    times: dict[str, list[float]] = {unknown: [], wrong_secret: []}
    with httpx.Client(timeout=10) as client:
        for _ in range(20):  # warm up connections and code paths
            elapsed_ms(unknown, client)
        for i in range(180):
            for token in (unknown, wrong_secret) if i % 2 else (wrong_secret, unknown):
                times[token].append(elapsed_ms(token, client))
    unknown_ms = statistics.median(times[unknown])
    wrong_ms = statistics.median(times[wrong_secret])
    print(f"auth timing: unknown {unknown_ms:.2f} ms, wrong secret {wrong_ms:.2f} ms")
    assert abs(unknown_ms - wrong_ms) <= max(1.0, 0.25 * min(unknown_ms, wrong_ms))
    assert real_key.prefix == wrong_secret[:len(real_key.prefix)]
