"""A secret parked between POST and GET: neither the session store nor the cookie alone opens it."""

from __future__ import annotations

import pytest
from django.contrib.sessions.backends.db import SessionStore
from django.test import RequestFactory

from infra import sealed_once

PAYLOAD = {"key_id": 7, "plaintext": "sk-live-abc"}


def test_round_trip_and_neither_half_alone() -> None:
    sealed, key = sealed_once.seal("slot", PAYLOAD)
    assert sealed_once.unseal("slot", sealed, key) == PAYLOAD
    assert "sk-live-abc" not in sealed and "sk-live-abc" not in key
    _, other_key = sealed_once.seal("slot", PAYLOAD)
    assert sealed_once.unseal("slot", sealed, other_key) is None


@pytest.mark.parametrize("tamper", [
    lambda s, k: ("other-slot", s, k),  # replayed into another parking slot
    lambda s, k: ("slot", s[:-4] + ("AAAA" if not s.endswith("AAAA") else "BBBB"), k),
    lambda s, k: ("slot", s, k[:-2]),  # a truncated key
    lambda s, k: ("slot", "not base64 !", k),
    lambda s, k: ("slot", s, ""),
])
def test_altered_or_misplaced_halves_open_nothing(tamper) -> None:
    sealed, key = sealed_once.seal("slot", PAYLOAD)
    assert sealed_once.unseal(*tamper(sealed, key)) is None


@pytest.mark.django_db
def test_park_then_take_once() -> None:
    request = RequestFactory().post("/")
    request.session = SessionStore()
    response = sealed_once.park(request, sealed_once.HttpResponse(), "slot", PAYLOAD)
    cookie = response.cookies[sealed_once.COOKIE]
    assert cookie["httponly"] and cookie["samesite"] == "Strict"
    assert "sk-live-abc" not in str(dict(request.session))

    later = RequestFactory().get("/")
    later.session = request.session
    later.COOKIES[sealed_once.COOKIE] = cookie.value
    assert sealed_once.take(later, "slot") == PAYLOAD
    assert sealed_once.take(later, "slot") is None  # shown at most once
