"""Create a served model: the public name tenants pass as ``model``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from catalog.models import ServedModel
from workers.management.catalog_options import (
    MODEL_FIELDS,
    add_field_arguments,
    apply_fields,
    describe_model,
    save_model,
)


class Command(BaseCommand):
    help = ("Create a model. It is served once a pool of it has a running worker "
            "(create_pool).")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the name tenants pass as `model`, e.g. sim-embed")
        add_field_arguments(parser, MODEL_FIELDS)

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["name"]
        if ServedModel.objects.filter(name=name).exists():
            raise CommandError(f"a model named {name!r} already exists (change it with "
                               "change_model)")
        model = ServedModel(name=name, engine_model_id=name)
        apply_fields(model, options, MODEL_FIELDS)
        save_model(model)
        self.stdout.write(f"Created {describe_model(model)}.")
