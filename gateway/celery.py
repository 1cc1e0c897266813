"""The Celery app, on Redis: its settings, the engine host option and the periodic schedule.

Settings come from Django's ``CELERY_*`` settings. This module is imported with the ``gateway``
package, before Django is set up, so it names tasks and the engine host's bootstep instead of
importing them (they import models).
"""

from __future__ import annotations

import os

import click
from celery import Celery
from django.conf import settings
from redis.connection import parse_url

from infra.redis_conn import redis_url

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gateway.settings")

app = Celery("gateway")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.on_configure.connect
def _use_gateway_redis(sender: Celery, **_: object) -> None:
    # The broker defaults to the gateway's Redis (embedded when REDIS_URL is empty).
    if not settings.CELERY_BROKER_URL and settings.REDIS_SENTINEL_NODES:
        # Through the same sentinels (kombu's sentinel:// transport): the broker follows a
        # failover as the gateway's clients do.
        # redis-py leaves parse_url unannotated.
        db = parse_url(settings.REDIS_URL).get(  # type: ignore[no-untyped-call]
            "db", 0) if settings.REDIS_URL else 0
        url = ";".join(f"sentinel://{h}:{p}/{db}" for h, p in settings.REDIS_SENTINEL_NODES)
        master = {"master_name": settings.REDIS_SENTINEL_MASTER}
        sender.conf.broker_transport_options = {**settings.CELERY_BROKER_TRANSPORT_OPTIONS,
                                                **master}
        sender.conf.result_backend_transport_options = master
    else:
        url = settings.CELERY_BROKER_URL or redis_url()
    sender.conf.update(broker_url=url, result_backend=url)


app.autodiscover_tasks()

# `celery -A gateway worker --engine-pool NAME` hosts that pool's engine (workers.host).
app.user_options["worker"].add(click.Option(
    ["--engine-pool"], default=None, help="Host the engine of this Pool (by name)."))
app.user_options["worker"].add(click.Option(
    ["--engine-worker-id"], default=None, help="Worker id in Redis (default: generated)."))
app.steps["worker"].add("workers.host:EngineHostStep")

# Run under `celery beat` (or a worker started with -B). Every task is short, idempotent and
# takes a lease where it must, so overlapping runs are harmless and a missed run is caught up
# by the next one.
JANITOR_EVERY_S = 5.0


def janitor_every_s() -> float:
    """Often enough that a dead worker's streams end within WORKER_DEAD_AFTER_SECONDS and a
    half; never more often than WORKER_HEARTBEAT_SECONDS."""
    return max(settings.WORKER_HEARTBEAT_SECONDS,
               min(JANITOR_EVERY_S, settings.WORKER_DEAD_AFTER_SECONDS / 2))


PERIODIC_TASKS: tuple[tuple[str, float, str], ...] = (
    # A backstop: pool workers already sweep, but a pool whose workers all died has nobody
    # left to sweep it (`manage.py serve` runs a housekeeping worker for this).
    ("workers.janitor_sweep", janitor_every_s(), "janitor sweep"),
    ("metering.flush_usage", 2.0, "flush usage records"),
    ("metering.rollup_usage", 30.0, "roll up usage by hour"),
    ("metering.purge_request_log", 3600.0, "purge the request log past its retention"),
    ("contentlog.drain", 2.0, "write content log"),
    ("contentlog.purge_expired", 300.0, "purge expired content"),
    ("billing.check_spend_alerts", 60.0, "spend alerts"),
    ("billing.purge_exports", 3600.0, "purge week-old exports"),
    # Split quotas across cells (docs/adr/0019); a no-op without CELLS.
    ("cells.rebalance_quotas", settings.CELL_REBALANCE_SECONDS, "rebalance cell quota shares"),
)
for _task, _every, _label in PERIODIC_TASKS:
    # A run nobody picked up within its period is dropped: the next one does the same work.
    app.add_periodic_task(_every, app.signature(_task).set(expires=_every), name=_label)
