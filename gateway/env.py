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


def env_cidrs(name: str) -> list[str]:
    """Comma-separated networks (``10.0.0.0/8,::1``); a bad one stops start-up."""
    import ipaddress

    cidrs = env_list(name, [])
    for cidr in cidrs:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ImproperSetting(f"{name}: {cidr!r} is not a CIDR") from None
    return cidrs


def env_ports(name: str, default: list[int]) -> list[int]:
    ports = []
    for item in env_list(name, [str(p) for p in default]):
        if not item.isdigit() or not 1 <= int(item) <= 65535:
            raise ImproperSetting(f"{name}: {item!r} is not a TCP port")
        ports.append(int(item))
    return ports


def env_proxy_ssl_header(name: str, default: str) -> tuple[str, str] | None:
    """``"X-Forwarded-Proto: https"`` -> Django's ``("HTTP_X_FORWARDED_PROTO", "https")``;
    empty or ``off`` -> None (requests are https only when the socket is)."""
    value = (_raw(name) or default).strip()
    if value.lower() in {"", "off", "none", "false"}:
        return None
    header, sep, expected = value.partition(":")
    if not sep or not header.strip() or not expected.strip():
        raise ImproperSetting(f"{name}={value!r} must look like 'X-Forwarded-Proto: https'")
    return "HTTP_" + header.strip().upper().replace("-", "_"), expected.strip()


def require_production_secrets(*, secret_key: str, dev_secret_key: str, peppers: dict[int, str],
                               dev_pepper: str, cache_salt_secret: str,
                               content_log_master_keys: str) -> None:
    """Refuse development or missing secrets in production, naming the variable to set."""
    why = "DEBUG is off (production)"
    if secret_key == dev_secret_key:
        raise ImproperSetting(f"SECRET_KEY must be set to your own secret: {why}")
    if dev_pepper in peppers.values():
        raise ImproperSetting(
            f"API_KEY_PEPPERS (or API_KEY_PEPPER) must be set to your own secret: {why}")
    if not cache_salt_secret:
        raise ImproperSetting(f"CACHE_SALT_SECRET must be set (its own secret): {why}")
    if cache_salt_secret in (secret_key, dev_secret_key):
        raise ImproperSetting(f"CACHE_SALT_SECRET must differ from SECRET_KEY: {why}")
    if len(cache_salt_secret) < 32:
        raise ImproperSetting("CACHE_SALT_SECRET must be at least 32 characters")
    if not content_log_master_keys:
        raise ImproperSetting(f"CONTENT_LOG_MASTER_KEYS must be set: {why}")
