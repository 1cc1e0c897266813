"""Crypto-shred a tenant's content log: destroy its data keys, then delete its records."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from gateway.contentlog.lifecycle import shred_tenant_content
from tenants.models import Tenant


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("tenant", help="tenant slug")
        parser.add_argument("--yes", action="store_true", help="do not ask")

    def handle(self, *args: Any, **options: Any) -> None:
        tenant = Tenant.objects.filter(slug=options["tenant"]).first()
        if tenant is None:
            raise CommandError(f"no tenant {options['tenant']!r}")
        if not options["yes"]:
            raise CommandError("irreversible: pass --yes to shred")
        destroyed, records = shred_tenant_content(tenant, actor="manage.py shred_tenant_content")
        self.stdout.write(f"{tenant.slug}: destroyed {destroyed} data keys, "
                          f"deleted {records} records")
