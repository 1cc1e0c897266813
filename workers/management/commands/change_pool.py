"""Change a pool (only the options given): its model, capacity, owner, settings, on or off."""

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
    help = "Change a pool. Its workers read most settings when they (re)start."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the pool's name")
        parser.add_argument("--model", help="the model it serves")
        owner = parser.add_mutually_exclusive_group()
        owner.add_argument("--dedicated-to", metavar="TENANT", help="dedicate it to a tenant")
        owner.add_argument("--shared", action="store_true", help="make it a shared pool")
        state = parser.add_mutually_exclusive_group()
        state.add_argument("--enable", action="store_true", help="route requests to it")
        state.add_argument("--disable", action="store_true", help="stop routing to it")
        add_field_arguments(parser, POOL_FIELDS)
        add_setting_arguments(parser)
        parser.add_argument("--unset", action="append", default=[], metavar="KEY",
                            help="remove a backend setting (repeat for more)")

    def handle(self, *args: Any, **options: Any) -> None:
        pool = Pool.objects.select_related("model", "dedicated_to").filter(
            name=options["name"]).first()
        if pool is None:
            raise CommandError(f"no pool named {options['name']!r} (create it with create_pool)")
        if options["model"]:
            pool.model = model_named(options["model"])
        if options["dedicated_to"]:
            pool.dedicated_to = tenant_slug(options["dedicated_to"])
        elif options["shared"]:
            pool.dedicated_to = None
        if options["enable"] or options["disable"]:
            pool.enabled = bool(options["enable"])
        backend_settings = dict(pool.backend_settings or {})
        for key in options["unset"] or []:
            if key not in backend_settings:
                raise CommandError(f"--unset {key!r}: the pool has no such setting")
            del backend_settings[key]
        pool.backend_settings = {**backend_settings, **parse_settings(options["settings"] or [])}
        apply_fields(pool, options, POOL_FIELDS)
        save_pool(pool)
        self.stdout.write(f"Changed {describe_pool(pool)}.")
