"""ASGI entry point: Channels routes the inference API, Django serves everything else."""

from __future__ import annotations

import gc
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

# Everything loaded so far (Django, the apps, the routes: some 140,000 objects) lives as long as
# the process: kept out of the collector's full passes, each of which walked all of it (86 ms
# of the event loop at a time under bench/ab.py's load, a stall every stream waited out).
gc.freeze()
