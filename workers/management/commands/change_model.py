"""Change a served model's settings (only the options given)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from workers.management.catalog_options import (
    MODEL_FIELDS,
    add_field_arguments,
    apply_fields,
    describe_model,
    model_named,
    save_model,
)


class Command(BaseCommand):
    help = ("Change a model. Running workers keep the context window they started with until "
            "they restart.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the model's name")
        add_field_arguments(parser, MODEL_FIELDS)

    def handle(self, *args: Any, **options: Any) -> None:
        model = model_named(options["name"])
        apply_fields(model, options, MODEL_FIELDS)
        save_model(model)
        self.stdout.write(f"Changed {describe_model(model)}.")
