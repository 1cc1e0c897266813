"""Reading Prometheus exposition text in tests, with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition: (name, labels) -> value. Raises on malformed text."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float | None:
    """One sample's value, or None if the exposition has no such series."""
    return samples(text).get((name, frozenset(labels.items())))
