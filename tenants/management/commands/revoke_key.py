"""Revoke an API key by id, display prefix, or the key itself."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import QuerySet

from tenants.api_keys import candidate_hashes, parse_key
from tenants.models import ApiKey


class Command(BaseCommand):
    help = "Revoke an API key; every gateway process refuses it within a second."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("key", help="the key's id, its display prefix (e.g. igw_AbCd1234), "
                                        "or the full key")

    def handle(self, *args: Any, **options: Any) -> None:
        matches = self._find(options["key"].strip())
        count = matches.count()
        if count == 0:
            raise CommandError(f"no API key matches {options['key']!r}")
        if count > 1:
            raise CommandError(f"{count} keys match {options['key']!r}; give the key's id")
        api_key = matches.get()
        if api_key.revoked_at is not None:
            raise CommandError(f"key {api_key.masked} (id {api_key.pk}) was already revoked "
                               f"at {api_key.revoked_at:%Y-%m-%d %H:%M:%S %Z}")
        api_key.revoke()
        self.stdout.write(f"Revoked key {api_key.masked} (id {api_key.pk}) "
                          f"of tenant {api_key.tenant.slug}.")

    def _find(self, ref: str) -> QuerySet[ApiKey]:
        keys = ApiKey.objects.select_related("tenant")
        if ref.isdigit():
            return keys.filter(pk=int(ref))
        if parse_key(ref) is not None:
            return keys.filter(key_hash__in=[h for _, h in candidate_hashes(ref)])
        if len(ref) < 6:
            raise CommandError("a prefix must be at least 6 characters")
        return keys.filter(prefix__startswith=ref)
