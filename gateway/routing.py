"""HTTP routes served by Channels consumers (the OpenAI-compatible inference API).

Kept apart from ``urls.py`` because these consumers stream and must not go through Django's
request/response cycle. Anything else under ``/v1/`` answers an OpenAI-shaped 404.
``/v1/openapi.json`` describes the API (``gateway.inference.openapi``).
``/metrics`` is Prometheus text (``metering.metrics``).
"""

from __future__ import annotations

from django.urls import URLPattern, path, re_path

from gateway.inference import openapi
from gateway.inference.consumers import (
    ChatCompletionsConsumer,
    CompletionsConsumer,
    EmbeddingsConsumer,
    MetricsConsumer,
    ModelsConsumer,
    NotFoundConsumer,
    ResponsesConsumer,
)


def inference_routes() -> list[URLPattern]:
    return [
        path("v1/chat/completions", ChatCompletionsConsumer.as_asgi()),
        path("v1/completions", CompletionsConsumer.as_asgi()),
        path("v1/responses", ResponsesConsumer.as_asgi()),
        path("v1/embeddings", EmbeddingsConsumer.as_asgi()),
        path("v1/models", ModelsConsumer.as_asgi()),
        re_path(r"^v1/models/(?P<model>[^/]+)$", ModelsConsumer.as_asgi()),
        path("v1/openapi.json", openapi.consumer().as_asgi()),
        re_path(r"^v1/", NotFoundConsumer.as_asgi()),
        path("metrics", MetricsConsumer.as_asgi()),
    ]
