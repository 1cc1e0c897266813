"""Command-line options and saving for models and pools, shared by the catalog commands
(``create_model``, ``change_model``, ``create_pool``, ``change_pool``).

Every change goes through the model's own validation (``full_clean``) and the backend's
settings check (``workers.engine.registry.check_pool_settings``, the one the admin uses), so a
command refuses what the admin would, with one line naming the option. Saving sends the usual
signals; running gateways read the pool table within a few seconds, and ``serve`` starts a new
pool's worker on its next start (or run one with ``celery -A gateway worker --engine-pool
NAME``). The commands live with the workers because that check is the engines'.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.db import models

from catalog.models import Pool, ServedModel
from tenants.management.options import command_error
from tenants.models import Tenant
from workers.engine.registry import check_pool_settings

MODEL_FIELDS = {  # option dest -> (type, help)
    "engine_model_id": (str, "model path or id for the engine (default: the name)"),
    "tokenizer_path": (str, "directory with tokenizer.json; empty = the simulated tokenizer"),
    "max_model_len": (int, "context window in tokens"),
    "task": (str, "generate (chat, completions) or embed (/v1/embeddings)"),
    "tool_call_parser": (str, "hermes, llama3_json or mistral"),
    "parameter_count": (int, "weights, for the capacity planner"),
}
POOL_FIELDS = {
    "backend": (str, "simulated, vllm or openai_upstream"),
    "region": (str, "region its requests come from (default: settings.DEFAULT_REGION)"),
    "max_sequences": (int, "running sequences per engine instance"),
    "kv_cache_tokens": (int, "tokens of KV cache per engine instance"),
    "kv_overcommit": (float, "dispatch while reserved KV stays under capacity x this"),
    "cell": (str, "the cell hosting it (blank: no cells)"),
}


def add_field_arguments(parser: ArgumentParser, fields: dict[str, tuple[type, str]]) -> None:
    for dest, (kind, text) in fields.items():
        parser.add_argument("--" + dest.replace("_", "-"), dest=dest, type=kind, help=text)


def add_setting_arguments(parser: ArgumentParser) -> None:
    parser.add_argument("--set", dest="settings", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="a backend setting; VALUE is JSON (2000, true, \"text\") or text "
                             "(repeat for more)")


def apply_fields(obj: models.Model, options: dict[str, Any],
                 fields: dict[str, tuple[type, str]]) -> None:
    for dest in fields:
        if options.get(dest) is not None:
            setattr(obj, dest, options[dest])


def parse_settings(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise CommandError(f"--set {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw  # plain text
    return out


def model_named(name: str) -> ServedModel:
    model = ServedModel.objects.filter(name=name).first()
    if model is None:
        raise CommandError(f"no model named {name!r} (create it with create_model)")
    return model


def tenant_slug(slug: str | None) -> Tenant | None:
    if not slug:
        return None
    tenant = Tenant.objects.filter(slug=slug).first()
    if tenant is None:
        raise CommandError(f"no tenant with slug {slug!r}")
    return tenant


def save_model(model: ServedModel) -> None:
    _clean(model, {"name": "name"})
    model.save()


def save_pool(pool: Pool) -> None:
    _clean(pool, {"name": "name", "model": "--model", "dedicated_to": "--dedicated-to",
                  "backend_settings": "--set"})
    try:  # the backend's own rules, once the fields themselves are valid
        check_pool_settings(pool.name, pool.backend, dict(pool.backend_settings or {}),
                            pool.dedicated_to_id is not None)
    except ValueError as exc:
        raise CommandError(f"--set: {exc}") from None
    pool.save()


def _clean(obj: models.Model, names: dict[str, str]) -> None:
    """``full_clean``, its errors as one line naming each option."""
    try:
        obj.full_clean()
    except ValidationError as exc:
        if hasattr(exc, "error_dict"):
            lines = [f"{names.get(field, '--' + field.replace('_', '-'))}: {msg}"
                     for field, msgs in exc.message_dict.items() for msg in msgs]
            raise CommandError("; ".join(lines)) from None
        raise command_error(exc) from None


def describe_model(model: ServedModel) -> str:
    return (f"model {model.name} (task {model.task}, context {model.max_model_len}, "
            f"engine id {model.engine_model_id}, tokenizer "
            f"{model.tokenizer_path or 'simulated'})")


def describe_pool(pool: Pool) -> str:
    owner = f", dedicated to {pool.dedicated_to.slug}" if pool.dedicated_to else ""
    state = "enabled" if pool.enabled else "disabled"
    return (f"pool {pool.name} (model {pool.model.name}, backend {pool.backend}, region "
            f"{pool.region}, {pool.max_sequences} sequences, {state}{owner}, settings "
            f"{json.dumps(pool.backend_settings or {}, sort_keys=True)})")
