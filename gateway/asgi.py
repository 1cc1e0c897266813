"""ASGI entry point: Channels routes the inference API, Django serves everything else."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gateway.settings")

from django.core.asgi import get_asgi_application

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import re_path  # noqa: E402

from gateway.inference.bodylimit import BoundedBody  # noqa: E402
from gateway.routing import inference_routes  # noqa: E402
from infra import tracing  # noqa: E402

tracing.setup("inference-gateway")  # off unless the OTEL_* variables ask for traces

# Channels routes ASGI apps with Django's re_path, whose stubs expect a Django view.
catch_all = re_path(r"", BoundedBody(django_asgi_app))  # type: ignore[arg-type]
application = ProtocolTypeRouter({"http": URLRouter([*inference_routes(), catch_all])})
