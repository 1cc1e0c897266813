"""The one spelling of a certificate fingerprint, for the model that stores it and the mTLS
check that compares against it."""

from __future__ import annotations

import re

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def normalize_fingerprint(value: str | None) -> str | None:
    """``AB:CD:...`` / ``abcd...`` / ``sha256:...`` -> 64 lowercase hex digits, or None."""
    if not value:
        return None
    cleaned = value.strip().lower().removeprefix("sha256:").replace(":", "").replace(" ", "")
    return cleaned if _HEX64.match(cleaned) else None
