"""Create a tenant, its tier if new, and its default quota."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.core.validators import validate_slug
from django.db import transaction

from tenants.limits import validate_quota
from tenants.management.options import add_limit_arguments, collect, command_error
from tenants.models import QUOTA_FIELDS, Quota, Tenant, Tier


class Command(BaseCommand):
    help = "Create a tenant with a default quota. Options left out use the platform defaults."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug", help="URL-safe id, e.g. acme")
        parser.add_argument("--name", help="display name (default: the slug, titled)")
        parser.add_argument("--tier", default="standard", help="contract tier (created if new)")
        parser.add_argument("--weight", type=float,
                            help="scheduling weight of a new tier (default 1)")
        parser.add_argument("--region", help="home region (default: settings.DEFAULT_REGION)")
        parser.add_argument("--content-logging", action="store_true",
                            help="opt the tenant in to content logging")
        parser.add_argument("--suspended", action="store_true", help="create it suspended")
        add_limit_arguments(parser, QUOTA_FIELDS)

    def handle(self, *args: Any, **options: Any) -> None:
        slug = options["slug"]
        try:
            validate_slug(slug)
        except ValidationError:
            raise CommandError(
                f"slug {slug!r}: use letters, digits, hyphens and underscores only"
            ) from None
        if Tenant.objects.filter(slug=slug).exists():
            raise CommandError(f"a tenant with slug {slug!r} already exists")
        quota = collect(options, QUOTA_FIELDS)
        try:
            validate_quota(quota)
        except ValidationError as exc:
            raise command_error(exc) from None
        with transaction.atomic():
            tenant = Tenant(
                slug=slug, name=options["name"] or slug.replace("-", " ").title(),
                tier=self._tier(options["tier"], options["weight"]),
                content_logging=options["content_logging"],
                status=Tenant.Status.SUSPENDED if options["suspended"] else Tenant.Status.ACTIVE,
            )
            if options["region"]:
                tenant.region = options["region"]
            tenant.save()
            Quota.objects.create(tenant=tenant, **quota)
        self.stdout.write(f"Created tenant {tenant.slug} (id {tenant.pk}, tier {tenant.tier}).")

    def _tier(self, name: str, weight: float | None) -> Tier:
        if weight is not None and not weight >= 0.01:
            raise CommandError(f"--weight must be at least 0.01, got {weight}")
        tier = Tier.objects.filter(name=name).first()
        if tier is None:
            return Tier.objects.create(name=name, weight=1.0 if weight is None else weight)
        if weight is not None and weight != tier.weight:
            raise CommandError(
                f"tier {name!r} exists with weight {tier.weight:g}; change it in the admin "
                "(it applies to every tenant on the tier) or pick another tier"
            )
        return tier
