"""The Redis keys of the usage pipeline: settlement pushes onto ``pending``, the writer drains it.

Separate from ``metering.writer`` so the serving core can name the queue it feeds without
importing the ORM.
"""

from __future__ import annotations

from infra.redis_conn import key


def pending_key() -> str:
    """Usage records (JSON, counts only) that settlement pushed and no writer has claimed."""
    return key("usage", "pending")


def processing_key() -> str:
    return key("usage", "processing")


def dead_key() -> str:
    return key("usage", "dead")


def dirty_hours_key() -> str:
    return key("usage", "dirty_hours")
