"""Re-encrypt a tenant's content log under a new data key, then destroy the old key."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from gateway.contentlog.lifecycle import reencrypt_tenant
from tenants.models import Tenant


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("tenant", help="tenant slug")

    def handle(self, *args: Any, **options: Any) -> None:
        tenant = Tenant.objects.filter(slug=options["tenant"]).first()
        if tenant is None:
            raise CommandError(f"no tenant {options['tenant']!r}")
        self.stdout.write(f"{tenant.slug}: re-sealed {reencrypt_tenant(tenant)} records")
