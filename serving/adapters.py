"""LoRA adapters are tenant data: each belongs to one tenant and serves only that tenant.

A pool lists its adapters in ``backend_settings["lora"]["adapters"]``::

    {"name": "support-bot", "tenant_id": 12, "path": "/models/tenants/12/lora/support-bot"}

- The public name is scoped by its owner: two tenants may each have a "support-bot". Any other
  tenant naming it gets exactly what an unknown model gets ("not found"), so a tenant cannot
  even learn that another tenant's adapter exists (``resolve`` / ``visible_names``, for the API
  layer's routing and ``/v1/models``).
- Its files must live in the owner's storage partition (``{adapter_root}/{tenant_id}/...``)
  when the pool sets ``adapter_root``.
- The engine checks ownership again, without trusting the layer above: a request carries its
  tenant's prefix-cache salt (an HMAC of the tenant id, ``tenants.salts``), so the engine loads
  an adapter only for a request whose salt is its owner's salt (``for_request``).
- The engine-side name and integer id (vLLM's ``lora_name`` / ``lora_int_id``) are derived from
  (owner, name), so they are unique across tenants and identical in every worker of the pool.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from tenants.salts import cache_salt


class AdapterNotFound(LookupError):
    """No adapter of that name for this tenant (whether or not another tenant has one)."""


class AdapterConfigError(ValueError):
    """The pool's adapter list is invalid."""


@dataclass(frozen=True)
class Adapter:
    name: str  # public name, unique per owner
    tenant_id: int
    path: str
    upstream_model: str | None = None  # the model name an upstream server knows it by

    @property
    def engine_name(self) -> str:
        """Unique in the engine across tenants (vLLM keys loaded adapters by name and id)."""
        return f"t{self.tenant_id}-{self.name}"

    @property
    def int_id(self) -> int:
        """Stable positive id for vLLM's ``lora_int_id`` (same in every worker and restart)."""
        digest = hashlib.blake2b(self.engine_name.encode(), digest_size=4).digest()
        return (int.from_bytes(digest, "big") & 0x7FFFFFFF) or 1


def _default_salt(tenant_id: int) -> str:
    return cache_salt(tenant_id)


class AdapterCatalog:
    """A pool's adapters, looked up by (tenant, name) or by a request's cache salt."""

    def __init__(
        self,
        adapters: Iterable[Adapter] = (),
        salt_of: Callable[[int], str] = _default_salt,
    ) -> None:
        self._by_owner: dict[tuple[int, str], Adapter] = {}
        ids: dict[int, Adapter] = {}
        for a in adapters:
            if (a.tenant_id, a.name) in self._by_owner:
                raise AdapterConfigError(f"tenant {a.tenant_id} has two adapters named {a.name!r}")
            if a.int_id in ids:  # 31-bit hash collision: rename one of them
                raise AdapterConfigError(
                    f"adapters {a.engine_name!r} and {ids[a.int_id].engine_name!r} hash to the "
                    "same id; rename one")
            ids[a.int_id] = a
            self._by_owner[(a.tenant_id, a.name)] = a
        self._salt_of = salt_of
        self._salts: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._by_owner)

    def __iter__(self) -> Iterator[Adapter]:
        return iter(self._by_owner.values())

    def resolve(self, name: str, tenant_id: int) -> Adapter:
        """The tenant's adapter of that name; ``AdapterNotFound`` otherwise (API: 404)."""
        adapter = self._by_owner.get((int(tenant_id), name))
        if adapter is None:
            raise AdapterNotFound(name)
        return adapter

    def visible_names(self, tenant_id: int) -> list[str]:
        """Adapter names to list in this tenant's ``/v1/models`` (its own only)."""
        return sorted(n for (t, n) in self._by_owner if t == int(tenant_id))

    def for_request(self, name: str, cache_salt: str) -> Adapter:
        """The adapter for a request carrying ``cache_salt``: only its owner's salt matches."""
        for (tenant_id, adapter_name), adapter in self._by_owner.items():
            if adapter_name == name and self._owner_salt(tenant_id) == cache_salt:
                return adapter
        raise AdapterNotFound(name)

    def _owner_salt(self, tenant_id: int) -> str:
        salt = self._salts.get(tenant_id)
        if salt is None:
            salt = self._salts[tenant_id] = self._salt_of(tenant_id)
        return salt

    @classmethod
    def of_pool(cls, name: str, backend: str, backend_settings: dict[str, Any]) -> AdapterCatalog:
        """A pool's adapters, from its backend settings (the gateway resolves names with it, the
        engine loads them); ``AdapterConfigError`` says what is wrong with the settings."""
        lora = backend_settings.get("lora") or {}
        if lora.get("adapters") and not lora.get("enabled", backend == "openai_upstream"):
            raise AdapterConfigError("adapters are listed but lora.enabled is off")
        return cls.from_settings(lora)

    @classmethod
    def from_settings(
        cls, lora: dict[str, Any] | None, salt_of: Callable[[int], str] = _default_salt
    ) -> AdapterCatalog:
        """Parse ``backend_settings["lora"]``; raises ``AdapterConfigError`` with the reason."""
        lora = lora or {}
        root = lora.get("adapter_root")
        adapters = []
        for i, raw in enumerate(lora.get("adapters") or []):
            adapters.append(_parse(raw, i, root))
        return cls(adapters, salt_of)


def _parse(raw: Any, index: int, root: str | None) -> Adapter:
    where = f"lora.adapters[{index}]"
    if not isinstance(raw, dict):
        raise AdapterConfigError(f"{where} must be an object")
    unknown = set(raw) - {"name", "tenant_id", "path", "upstream_model"}
    if unknown:
        raise AdapterConfigError(f"{where}: unknown fields {sorted(unknown)}")
    name, tenant, path = raw.get("name"), raw.get("tenant_id"), raw.get("path")
    if not isinstance(name, str) or not name or "/" in name:
        raise AdapterConfigError(f"{where}.name must be a non-empty name without '/'")
    if not isinstance(tenant, int) or isinstance(tenant, bool) or tenant < 1:
        raise AdapterConfigError(f"{where}.tenant_id must be a tenant id (a positive integer)")
    if not isinstance(path, str) or not path:
        raise AdapterConfigError(f"{where}.path is required")
    if root is not None and not _inside(path, f"{root.rstrip('/')}/{tenant}"):
        raise AdapterConfigError(
            f"{where}: {path!r} is outside tenant {tenant}'s storage ({root}/{tenant}/)")
    return Adapter(name, tenant, path, raw.get("upstream_model"))


def _inside(path: str, root: str) -> bool:
    # Lexical check on normalised paths: ".." cannot climb out of the tenant's partition.
    p, r = PurePosixPath(path), PurePosixPath(root)
    if ".." in p.parts:
        return False
    return p == r or r in p.parents
