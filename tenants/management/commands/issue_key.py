"""Issue an API key. The key alone goes to stdout, so scripts can capture it; the rest to stderr."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from catalog.models import ServedModel
from tenants.api_keys import issue_key
from tenants.limits import validate_key_caps
from tenants.management.options import add_limit_arguments, collect, command_error
from tenants.models import LIMIT_FIELDS, Tenant


class Command(BaseCommand):
    help = "Issue an API key for a tenant and print it once (stdout: the key only)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("tenant", help="tenant slug")
        parser.add_argument("--name", default="default", help="a label for the key")
        parser.add_argument("--models", default="",
                            help="comma-separated model names the key may use (default: all)")
        parser.add_argument("--expires-in-days", type=float, metavar="N",
                            help="expire after N days (default: never)")
        add_limit_arguments(parser, LIMIT_FIELDS)

    def handle(self, *args: Any, **options: Any) -> None:
        tenant = Tenant.objects.filter(slug=options["tenant"]).first()
        if tenant is None:
            raise CommandError(f"no tenant with slug {options['tenant']!r}")
        name = options["name"].strip()
        if not name or len(name) > 100:
            raise CommandError("--name must be 1-100 characters")
        caps = collect(options, LIMIT_FIELDS)
        try:
            validate_key_caps(tenant, caps)
        except ValidationError as exc:
            raise command_error(exc) from None
        api_key, plaintext = issue_key(
            tenant, name, allowed_models=self._models(options["models"]),
            expires_at=self._expiry(options["expires_in_days"]), **caps,
        )
        self.stderr.write(
            f"Issued key {api_key.masked} (id {api_key.pk}) for tenant {tenant.slug}. "
            "It is printed once, below; store it now."
        )
        self.stdout.write(plaintext)

    def _models(self, names: str) -> list[ServedModel]:
        wanted = {n.strip() for n in names.split(",") if n.strip()}
        models = list(ServedModel.objects.filter(name__in=wanted))
        missing = wanted - {m.name for m in models}
        if missing:
            raise CommandError(f"--models: no such model(s): {', '.join(sorted(missing))}")
        return models

    def _expiry(self, days: float | None) -> Any:
        if days is None:
            return None
        if not 0 < days <= 3650:
            raise CommandError(f"--expires-in-days must be above 0 and at most 3650, got {days:g}")
        return timezone.now() + timedelta(days=days)
