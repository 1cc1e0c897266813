"""The pool catalog: the models the gateway serves, the pools that serve them, and the routes
that spread a public model name over several pools.

Below ``serving`` and ``tenants`` (docs/architecture.md): nothing here imports a project
package but ``infra``. A pool dedicated to a tenant names it by the string
``"tenants.Tenant"``, so the relation is Django's, not an import. The tables were made by the
``tenants`` app and keep their names (docs/adr/0030-catalog-package.md).
"""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from catalog.geometry import kv_bytes_per_token


class ServedModel(models.Model):
    """A public model name, the engine's id for it, and the geometry that sizes its KV cache."""

    name = models.SlugField(max_length=128, unique=True, help_text="Name tenants pass as `model`.")
    engine_model_id = models.CharField(max_length=255, help_text="Model path or id for the engine.")
    tokenizer_path = models.CharField(
        max_length=500,
        blank=True,
        help_text=(
            "Directory with tokenizer.json (and chat template); empty = the built-in sim model."
        ),
    )
    max_model_len = models.PositiveIntegerField(default=8192, validators=[MinValueValidator(16)])
    tool_call_parser = models.CharField(
        max_length=32, default="hermes",
        choices=[("hermes", "Hermes <tool_call> JSON (Qwen, Hermes)"),
                 ("llama3_json", "Llama 3 JSON"), ("mistral", "Mistral [TOOL_CALLS]")],
        help_text="How this model writes tool calls (parsed for tool_choice auto).",
    )
    task = models.CharField(
        max_length=16, default="generate",
        choices=[("generate", "Text generation (chat, completions)"),
                 ("embed", "Embeddings (/v1/embeddings)")],
        help_text="What the model serves; vLLM pools of an embedding model run its pooling "
                  "runner.",
    )
    num_layers = models.PositiveIntegerField(default=32, validators=[MinValueValidator(1)])
    num_kv_heads = models.PositiveIntegerField(default=8, validators=[MinValueValidator(1)])
    head_dim = models.PositiveIntegerField(default=128, validators=[MinValueValidator(1)])
    bytes_per_value = models.PositiveSmallIntegerField(default=2, validators=[MinValueValidator(1)])
    parameter_count = models.BigIntegerField(
        default=8_000_000_000, validators=[MinValueValidator(1)],
        help_text="Used by the capacity planner to size the weights.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "tenants_servedmodel"  # made by the tenants app; the rows stay put
        ordering = ["name"]
        verbose_name = "model"

    def __str__(self) -> str:
        return self.name

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, self.bytes_per_value
        )


class Pool(models.Model):
    """Engine instances serving one model in one region, shared or dedicated to one tenant."""

    class Backend(models.TextChoices):
        SIMULATED = "simulated", "Simulated engine"
        VLLM = "vllm", "vLLM (in-process AsyncLLM)"
        OPENAI_UPSTREAM = "openai_upstream", "OpenAI-compatible upstream server"

    name = models.SlugField(max_length=64, unique=True)
    model = models.ForeignKey(ServedModel, on_delete=models.PROTECT, related_name="pools")
    region = models.CharField(max_length=64, default=settings.DEFAULT_REGION)
    backend = models.CharField(max_length=32, choices=Backend.choices, default=Backend.SIMULATED)
    backend_settings = models.JSONField(
        default=dict, blank=True, help_text="Backend-specific settings (rates, URLs, engine args)."
    )
    max_sequences = models.PositiveIntegerField(
        default=64, validators=[MinValueValidator(1)],
        help_text="Running sequences per engine instance.",
    )
    kv_cache_tokens = models.PositiveIntegerField(
        default=381_000, validators=[MinValueValidator(16)],
        help_text="Tokens of KV cache per engine instance.",
    )
    kv_overcommit = models.FloatField(
        default=1.0, validators=[MinValueValidator(0.1)],
        help_text="Dispatch while reserved KV tokens stay under capacity x overcommit.",
    )
    dedicated_to = models.ForeignKey(
        "tenants.Tenant", null=True, blank=True, on_delete=models.SET_NULL,
        related_name="dedicated_pools",
        help_text="Empty = shared pool. Set = only this tenant's requests are routed here.",
    )
    enabled = models.BooleanField(default=True)
    cell = models.CharField(
        max_length=64, blank=True, default="",
        help_text="The cell whose Redis and workers host this pool (docs/adr/0019). Blank: "
                  "any gateway may route here (a deployment without cells).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "tenants_pool"  # made by the tenants app; the rows stay put
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.model.name}, {self.region})"


class Route(models.Model):
    """A public model name served by several pools (docs/adr: routes and fairness across pools).

    Its targets are tried by priority (lower first); among the healthy targets of the best
    priority the gateway picks by weight and by this tenant's expected wait. A retryable
    failure before the first token is retried on another target, up to ``retries`` times;
    when every target is unhealthy or overloaded, the ``fallbacks`` (other public model names)
    are tried in order. A dedicated upstream provider is a pool with the ``openai_upstream``
    backend: its key is read by its worker from the environment variable its
    ``backend_settings.api_key_env`` names, never stored here.
    """

    name = models.CharField(max_length=200, unique=True,
                            help_text="The public model name clients send.")
    retries = models.PositiveSmallIntegerField(
        null=True, blank=True, validators=[MaxValueValidator(5)],
        help_text="Attempts on other targets after a retryable failure before the first token "
                  "(empty: the ROUTE_RETRIES setting).")
    fallbacks = models.JSONField(
        default=list, blank=True,
        help_text='Public model names to fall back to, in order, e.g. ["small-model"].')
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "tenants_route"  # made by the tenants app; the rows stay put
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        check_model_names(self.fallbacks, "fallbacks", exclude=self.name)


class RouteTarget(models.Model):
    route = models.ForeignKey(Route, on_delete=models.CASCADE, related_name="targets")
    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="route_targets")
    weight = models.FloatField(default=1.0, validators=[MinValueValidator(0.001)])
    priority = models.PositiveSmallIntegerField(
        default=0, help_text="Lower is tried first; a higher one only when every lower one is "
                             "unhealthy, overloaded or failed.")

    class Meta:
        db_table = "tenants_routetarget"  # made by the tenants app; the rows stay put
        ordering = ["route", "priority", "pool__name"]
        constraints = [models.UniqueConstraint(fields=["route", "pool"],
                                               name="route_target_once")]

    def __str__(self) -> str:
        return f"{self.route.name} -> {self.pool.name} (w {self.weight:g}, p {self.priority})"


MAX_FALLBACKS = 4


def check_model_names(value: object, field: str, *, exclude: str = "") -> None:
    """A fallback list: at most MAX_FALLBACKS distinct model names, not the model itself."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValidationError({field: "A list of model names."})
    if len(value) > MAX_FALLBACKS or len(set(value)) != len(value) or exclude in value:
        raise ValidationError({field: f"At most {MAX_FALLBACKS} distinct model names, not the "
                                      "model itself."})
