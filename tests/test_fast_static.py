"""The test harness's WhiteNoise listing, built once (tests/fast_static.py): a new middleware
serves the same static files with the same headers without listing them again, and settings
that change the headers get a listing of their own."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.staticfiles import finders
from whitenoise.middleware import WhiteNoiseMiddleware

CSS = "/static/admin/css/base.css"


def _served(middleware: WhiteNoiseMiddleware, url: str) -> tuple[int, list[tuple[str, str]]]:
    response = middleware.files[url].get_response("GET", {})
    if response.file is not None:
        response.file.close()
    return int(response.status), sorted(response.headers)


@pytest.fixture
def listings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the finders' listings from now on."""
    real = finders.get_finders
    counted: list[int] = []

    def get_finders() -> Any:
        counted.append(1)
        return real()

    monkeypatch.setattr(finders, "get_finders", get_finders)
    return counted


def test_a_new_middleware_serves_the_same_files_without_listing_them_again(
        listings: list[int]) -> None:
    first = WhiteNoiseMiddleware(lambda request: None)
    del listings[:]
    second = WhiteNoiseMiddleware(lambda request: None)
    assert not listings
    assert second.files.keys() == first.files.keys()
    assert len(first.files) > 50 and CSS in first.files
    assert _served(second, CSS) == _served(first, CSS)


def test_settings_that_change_the_headers_get_their_own_listing(
        settings: Any, listings: list[int]) -> None:
    WhiteNoiseMiddleware(lambda request: None)
    settings.WHITENOISE_MAX_AGE = 7
    other = WhiteNoiseMiddleware(lambda request: None)
    assert listings
    assert ("Cache-Control", "max-age=7, public") in _served(other, CSS)[1]
