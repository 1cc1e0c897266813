"""HTTP routes served by Channels consumers (the OpenAI-compatible inference API).

Kept apart from ``urls.py`` because these consumers stream and must not go through Django's
request/response cycle. The inference API issue fills this list.
"""

from __future__ import annotations

from django.urls import URLPattern


def inference_routes() -> list[URLPattern]:
    return []
