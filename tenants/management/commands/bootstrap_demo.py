"""Idempotent demo set-up for the embedded quick start.

Ensures: a ``standard`` tier, the ``sim-small`` model on the built-in simulated tokenizer, a
``sim-local`` pool on the simulated backend, the ``sim-embed`` embedding model on a
``sim-embed-local`` pool (so ``/v1/embeddings`` works at once), a ``demo`` tenant with a
default quota, and an ``admin`` superuser. Secrets are printed only when they are created:
the admin password when the user is new and GATEWAY_ADMIN_PASSWORD is not set, and a demo key
only when the demo tenant has no usable key. Running it again changes nothing and prints no secret.
"""

from __future__ import annotations

import secrets
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from catalog.models import Pool, ServedModel
from tenants.api_keys import issue_key
from tenants.demo import DEMO_EMBED_MODEL, DEMO_MODEL, try_it
from tenants.models import ApiKey, Quota, Tenant, Tier

DEMO_POOL = "sim-local"
DEMO_EMBED_POOL = "sim-embed-local"
DEMO_TENANT = "demo"
ADMIN_USER = "admin"


class Command(BaseCommand):
    help = "Ensure the demo tier, model, pool, tenant, admin user and key exist (idempotent)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                            help="Where the gateway will answer, for the printed examples.")

    def handle(self, *args: Any, **options: Any) -> None:
        password = settings.GATEWAY_ADMIN_PASSWORD
        if password and len(password) < 8:
            raise CommandError("GATEWAY_ADMIN_PASSWORD must be at least 8 characters")
        with transaction.atomic():
            tenant = self._tenant(self._model())
            generated = self._admin(password)
            plaintext = self._demo_key(tenant)
        if generated:
            self.stdout.write(f"Admin user '{ADMIN_USER}' created with password: {generated}")
            self.stdout.write("  (shown once; set GATEWAY_ADMIN_PASSWORD to choose it)")
        if plaintext:
            self.stdout.write(f"Demo API key for tenant '{DEMO_TENANT}' (shown once): {plaintext}")
            self.stdout.write(try_it(options["base_url"].rstrip("/"), plaintext))
        else:
            self.stdout.write(f"The demo key was shown when it was made; for another: "
                              f".venv/bin/python manage.py issue_key {DEMO_TENANT} --name demo")
        self.stdout.write(f"Demo ready: tenant '{DEMO_TENANT}', model '{DEMO_MODEL}' "
                          f"(pool '{DEMO_POOL}'), embedding model '{DEMO_EMBED_MODEL}' "
                          f"(pool '{DEMO_EMBED_POOL}').")

    def _model(self) -> ServedModel:
        model, _ = ServedModel.objects.get_or_create(
            name=DEMO_MODEL,
            defaults={"engine_model_id": DEMO_MODEL, "tokenizer_path": "", "max_model_len": 8192},
        )
        Pool.objects.get_or_create(
            name=DEMO_POOL, defaults={"model": model, "backend": Pool.Backend.SIMULATED}
        )
        embed, _ = ServedModel.objects.get_or_create(
            name=DEMO_EMBED_MODEL, defaults={"engine_model_id": DEMO_EMBED_MODEL,
                                             "tokenizer_path": "", "max_model_len": 8192,
                                             "task": "embed"},
        )
        Pool.objects.get_or_create(
            name=DEMO_EMBED_POOL, defaults={"model": embed, "backend": Pool.Backend.SIMULATED}
        )
        return model

    def _tenant(self, model: ServedModel) -> Tenant:
        tier, _ = Tier.objects.get_or_create(name="standard", defaults={"weight": 1.0})
        tenant, _ = Tenant.objects.get_or_create(
            slug=DEMO_TENANT, defaults={"name": "Demo", "tier": tier}
        )
        Quota.objects.get_or_create(tenant=tenant, model=None)  # platform defaults
        return tenant

    def _admin(self, password: str) -> str | None:
        """Create the superuser if missing; return the password only if we generated it."""
        users = get_user_model().objects
        if users.filter(username=ADMIN_USER).exists():
            return None
        generated = None if password else secrets.token_urlsafe(12)
        users.create_superuser(ADMIN_USER, "", password or generated)
        return generated

    def _demo_key(self, tenant: Tenant) -> str | None:
        if ApiKey.objects.filter(tenant=tenant).usable().exists():
            return None
        return issue_key(tenant, "demo")[1]
