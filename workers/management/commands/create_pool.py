"""Create a pool: engine instances serving one model, shared or dedicated to one tenant."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from catalog.models import Pool
from workers.management.catalog_options import (
    POOL_FIELDS,
    add_field_arguments,
    add_setting_arguments,
    apply_fields,
    describe_pool,
    model_named,
    parse_settings,
    save_pool,
    tenant_slug,
)


class Command(BaseCommand):
    help = ("Create a pool of a model. `manage.py serve` starts its worker when it starts; "
            "its model is listed in /v1/models once a worker serves it.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="pool name, e.g. sim-embed-local")
        parser.add_argument("--model", required=True, help="the model it serves")
        parser.add_argument("--dedicated-to", metavar="TENANT",
                            help="a tenant's slug: only its requests are routed here")
        parser.add_argument("--disabled", action="store_true", help="create it disabled")
        add_field_arguments(parser, POOL_FIELDS)
        add_setting_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["name"]
        if Pool.objects.filter(name=name).exists():
            raise CommandError(f"a pool named {name!r} already exists (change it with "
                               "change_pool)")
        pool = Pool(name=name, model=model_named(options["model"]),
                    dedicated_to=tenant_slug(options["dedicated_to"]),
                    enabled=not options["disabled"],
                    backend_settings=parse_settings(options["settings"] or []))
        apply_fields(pool, options, POOL_FIELDS)
        save_pool(pool)
        self.stdout.write(f"Created {describe_pool(pool)}.")
