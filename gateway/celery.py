"""The Celery app, on Redis. Settings come from Django's ``CELERY_*`` settings."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gateway.settings")

app = Celery("gateway")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.on_configure.connect
def _use_gateway_redis(sender: Celery, **_: object) -> None:
    # The broker defaults to the gateway's Redis (embedded when REDIS_URL is empty).
    from django.conf import settings

    from infra.redis_conn import redis_url

    url = settings.CELERY_BROKER_URL or redis_url()
    sender.conf.broker_url = url
    sender.conf.result_backend = url


app.autodiscover_tasks()


def _install_engine_host() -> None:
    # `celery -A gateway worker --engine-pool NAME` hosts that pool's engine (workers.host).
    from workers.host import install

    install(app)


_install_engine_host()
