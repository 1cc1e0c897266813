"""Environment readers that refuse bad values instead of guessing.

Each helper names the variable in its error, so a misconfigured deployment stops at start-up
with a message an operator can act on. ``NAME_FILE`` is honoured for secrets so containers
can mount them as files.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


class ImproperSetting(ValueError):
    """A setting from the environment has a value we cannot use."""


def _raw(name: str) -> str | None:
    file_var = os.environ.get(f"{name}_FILE")
    if file_var:
        try:
            return Path(file_var).read_text().strip()
        except OSError as exc:
            raise ImproperSetting(f"{name}_FILE={file_var!r} cannot be read: {exc}") from exc
    return os.environ.get(name)


def env_str(name: str, default: str | None = None, *, required: bool = False) -> str:
    value = _raw(name)
    if value is None or value == "":
        if required or default is None:
            raise ImproperSetting(f"{name} must be set")
        return default
    return value


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None or value == "":
        return default
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperSetting(f"{name}={value!r} is not a boolean (use true/false, 1/0, yes/no)")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperSetting(f"{name}={value!r} is not an integer") from None
    if minimum is not None and number < minimum:
        raise ImproperSetting(f"{name}={number} is below the minimum of {minimum}")
    return number


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperSetting(f"{name}={value!r} is not a number") from None
    if not math.isfinite(number):
        raise ImproperSetting(f"{name}={value!r} is not a finite number")
    if minimum is not None and number < minimum:
        raise ImproperSetting(f"{name}={number} is below the minimum of {minimum}")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    value = _raw(name)
    if value is None or value.strip() == "":
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def env_peppers(name: str, default: dict[int, str]) -> dict[int, str]:
    """Parse ``"2:newsecret,1:oldsecret"`` into {version: secret}.

    Several versions may be live at once so a pepper can rotate: new keys are hashed with the
    highest version, old keys still verify under the version stored beside their hash.
    """
    value = _raw(name)
    if value is None or value.strip() == "":
        return default
    peppers: dict[int, str] = {}
    for part in value.split(","):
        version, sep, secret = part.strip().partition(":")
        if not sep or not version.isdigit() or len(secret) < 16:
            raise ImproperSetting(
                f"{name} must look like '2:<secret of 16+ chars>,1:<older secret>'"
            )
        peppers[int(version)] = secret
    return peppers
