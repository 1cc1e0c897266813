"""Tenancy: who may call, what they may use, and how much.

The tenant ID that keys every queue, bucket, cache scope and log partition comes only from a
verified credential (``tenants.auth``), never from anything the caller sends (I1).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.dispatch import Signal
from django.utils import timezone

from catalog.models import Pool, ServedModel, check_model_names
from tenants.fingerprints import normalize_fingerprint
from tenants.limits import (
    LIMIT_FIELDS,
    QUOTA_DEFAULTS,
    QUOTA_FIELDS,
    field_errors,
    row_values,
    validate_quota,
)

__all__ = ["LIMIT_FIELDS", "QUOTA_DEFAULTS", "QUOTA_FIELDS"]  # re-exported: they live in limits

# Sent by ApiKeyQuerySet.revoke, whose bulk UPDATE sends no post_save.
keys_revoked = Signal()


class Tier(models.Model):
    """A contract tier. Its weight is the tenant's share under weighted fair queueing."""

    name = models.CharField(max_length=64, unique=True)
    weight = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(0.01)],
        help_text="Scheduling weight: a tier with weight 3 gets three times the share of weight 1.",
    )
    description = models.TextField(blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} (weight {self.weight:g})"


class TenantQuerySet(models.QuerySet["Tenant"]):
    def active(self) -> TenantQuerySet:
        return self.filter(status=Tenant.Status.ACTIVE)


class Tenant(models.Model):
    class Status(models.TextChoices):
        ACTIVE = "active", "Active"
        SUSPENDED = "suspended", "Suspended"

    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=64, unique=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    tier = models.ForeignKey(Tier, on_delete=models.PROTECT, related_name="tenants")
    region = models.CharField(max_length=64, default=settings.DEFAULT_REGION)
    # Cells (docs/adr/0019): requests are served in the home cell and the extra ones, and
    # forwarded there from any other; the token quota is split across them (serving.cells).
    home_cell = models.CharField(
        max_length=64, blank=True, default="",
        help_text="The cell that serves this tenant. Blank: the deployment's default cell.",
    )
    extra_cells = models.CharField(
        max_length=255, blank=True, default="",
        help_text="Comma-separated cells that also serve this tenant; its token quota is then "
                  "split across the home and these cells by recent demand.",
    )
    content_logging = models.BooleanField(
        default=False, help_text="Opt-in: store prompts and responses, encrypted, short retention."
    )
    response_cache = models.BooleanField(
        default=False, help_text="Opt-in: answer a repeated deterministic request (temperature 0 "
                                 "or a seed) from this tenant's own exact-match cache.")
    # Changed only through gateway.contentlog.lifecycle.set_retention_days, which also pulls in
    # the expiry of records already written; hence not editable in model forms.
    content_retention_days = models.PositiveSmallIntegerField(
        default=7, editable=False, validators=[MinValueValidator(1), MaxValueValidator(30)],
        help_text="Days a logged prompt/response is kept before the purge deletes it (1-30).",
    )
    end_user_header = models.CharField(
        max_length=64, blank=True, default="",
        help_text="A request header naming the end user for end-user budgets (e.g. "
                  "x-end-user). Blank: the body's safety_identifier or user field.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_active(self) -> bool:
        return self.status == self.Status.ACTIVE

    @property
    def cells(self) -> tuple[str, ...]:
        """The cells that serve this tenant, home first; () when the deployment has no cells."""
        home = self.home_cell or settings.DEFAULT_CELL
        if not home:
            return ()
        extra = (c.strip() for c in self.extra_cells.split(","))
        return (home, *dict.fromkeys(c for c in extra if c and c != home))

    def clean(self) -> None:
        super().clean()
        unknown = [c for c in self.cells if settings.CELLS and c not in settings.CELLS]
        if unknown:
            raise ValidationError({"extra_cells" if self.extra_cells else "home_cell":
                                   f"Unknown cell(s): {', '.join(unknown)}. "
                                   f"Configured: {', '.join(settings.CELLS)}."})

    def set_status(self, status: str) -> None:
        """Suspend or reactivate; the save signal makes every gateway see it within 1 s."""
        self.status = status
        self.save(update_fields=["status", "updated_at"])

    @property
    def dedicated_pool(self) -> Pool | None:
        return self.dedicated_pools.filter(enabled=True).first()


# Limit fields shared by tenant quotas and per-key limits. A quota row leaves a field empty to
# inherit it (per-model override -> tenant default); a key leaves it empty to use the tenant's.
def _positive_int(**kwargs: Any) -> models.PositiveIntegerField[int | None, int | None]:
    return models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], **kwargs
    )


def _positive_float(**kwargs: Any) -> models.FloatField[float | None, float | None]:
    return models.FloatField(null=True, blank=True, validators=[MinValueValidator(0.01)], **kwargs)


class Quota(models.Model):
    """A tenant's limits; ``model`` empty is the default, a model set overrides fields it fills."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="quotas")
    model = models.ForeignKey(
        ServedModel, null=True, blank=True, on_delete=models.CASCADE, related_name="+",
        help_text="Empty = the tenant's default quota for every model.",
    )
    input_tpm = _positive_int(help_text="Input (prompt) tokens per minute.")
    output_tpm = _positive_int(help_text="Output tokens per minute (max_tokens charged up front).")
    input_burst = _positive_int(help_text="Input bucket size in tokens; empty = one minute's rate.")
    output_burst = _positive_int(
        help_text="Output bucket size in tokens; empty = one minute's rate."
    )
    concurrent_requests = _positive_int()
    open_streams = _positive_int()
    max_context_tokens = _positive_int(help_text="Prompt + max_tokens may not exceed this.")
    max_output_tokens = _positive_int(help_text="Largest max_tokens one request may ask for.")
    ttft_deadline_s = _positive_float(help_text="Seconds to the first token before cancelling.")
    total_deadline_s = _positive_float(help_text="Seconds for the whole request before cancelling.")

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant"], condition=models.Q(model__isnull=True),
                name="one_default_quota_per_tenant",
            ),
            models.UniqueConstraint(
                fields=["tenant", "model"], condition=models.Q(model__isnull=False),
                name="one_quota_per_tenant_model",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant} quota ({self.model or 'default'})"

    def clean(self) -> None:
        if getattr(self, "defer_cross_row_checks", False):
            # The admin's inline formset checks this row against the default edited beside it.
            if errors := field_errors(row_values(self), QUOTA_FIELDS):
                raise ValidationError(errors)
            return
        base = None
        if self.model_id is not None and self.tenant_id is not None:
            base = row_values(Quota.objects.filter(tenant_id=self.tenant_id, model=None).first())
        validate_quota(row_values(self), base=base)


class ApiKeyQuerySet(models.QuerySet["ApiKey"]):
    def usable(self, now: datetime | None = None) -> ApiKeyQuerySet:
        """Not revoked and not expired: the only keys that authenticate."""
        now = now or timezone.now()
        return self.filter(revoked_at__isnull=True).filter(
            models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now)
        )

    def revoke(self) -> int:
        """Revoke every key in the set that is not revoked yet; every gateway drops it within 1 s.

        One UPDATE, so a key revoked twice keeps its first revocation time.
        """
        count = self.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        if count:
            keys_revoked.send(sender=ApiKey, count=count)  # tenants.signals: new auth epoch
        return count

    revoke.queryset_only = True  # type: ignore[attr-defined]  # never ApiKey.objects.revoke()


class ApiKey(models.Model):
    """An API key. Only an HMAC of it is stored; the key is shown once (``tenants.api_keys``)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    pepper_version = models.PositiveSmallIntegerField(editable=False)
    prefix = models.CharField(
        max_length=24, editable=False, db_index=True, help_text="Shown to identify the key."
    )
    last_four = models.CharField(max_length=4, editable=False)
    allowed_models = models.ManyToManyField(
        ServedModel, blank=True, related_name="+",
        help_text="Empty = every model the tenant may use.",
    )
    input_tpm = _positive_int(help_text="Per-key cap under the tenant's; empty = tenant's.")
    output_tpm = _positive_int()
    concurrent_requests = _positive_int()
    open_streams = _positive_int()
    max_output_tokens = _positive_int()
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    project = models.ForeignKey("tenants.Project", null=True, blank=True,
                                on_delete=models.SET_NULL, related_name="api_keys")
    # A spend alert's hard cap stops the key here (429 insufficient_quota), never by rewriting
    # its expiry: it still authenticates, reads "over budget", and an owner can resume it.
    over_budget_at = models.DateTimeField(null=True, blank=True, editable=False)
    response_cache = models.BooleanField(
        default=False, help_text="Opt-in for this key's requests (the tenant's switch turns it "
                                 "on for every key).")
    # Set when a successor was issued (``tenants.api_keys.rotate_key``): the key is retiring, works
    # until ``expires_at`` and cannot be rotated again (the successor is the one to rotate).
    rotated_at = models.DateTimeField(null=True, blank=True, editable=False)

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.masked})"

    @property
    def masked(self) -> str:
        return f"{self.prefix}…{self.last_four}"

    def revoke(self) -> bool:
        """Revoke this key; False if it was already revoked."""
        revoked = ApiKey.objects.filter(pk=self.pk).revoke() == 1
        self.refresh_from_db(fields=["revoked_at"])
        return revoked

    def is_usable(self, now: datetime | None = None) -> bool:
        now = now or timezone.now()
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > now

    def state(self, now: datetime | None = None) -> str:
        """What the portal, admin and API call it: revoked, expired, over budget or active."""
        if self.revoked_at is not None:
            return "revoked"
        if not self.is_usable(now):
            return "expired"
        return "over budget" if self.over_budget_at is not None else "active"

    def resume(self) -> bool:
        """Lift a spend alert's hard cap (the owner raised it or accepts the spend)."""
        if self.over_budget_at is None:
            return False
        self.over_budget_at = None
        self.save(update_fields=["over_budget_at"])  # the save signal renews every principal
        return True


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner", "Owner"
        MEMBER = "member", "Member"
        BILLING = "billing", "Billing"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["user", "tenant"], name="one_membership_per_user_tenant"
            )
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} ({self.role})"


class ContentLoggingChange(models.Model):
    """Who switched one of a tenant's content-storing opt-ins (content logging, the response
    cache) on or off, and when. Rows are never edited."""

    class Setting(models.TextChoices):
        CONTENT_LOGGING = "content_logging", "content logging"
        RESPONSE_CACHE = "response_cache", "response cache"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    setting = models.CharField(max_length=16, choices=Setting.choices,
                               default=Setting.CONTENT_LOGGING)
    enabled = models.BooleanField()
    changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    changed_at = models.DateTimeField(auto_now_add=True)
    remote_addr = models.GenericIPAddressField(null=True, blank=True)

    class Meta:
        db_table = "portal_contentloggingchange"  # made by the portal app; the data stays put
        ordering = ["-changed_at", "-id"]

    def __str__(self) -> str:
        state = "on" if self.enabled else "off"
        what = self.get_setting_display()
        return f"{self.tenant} {what} {state} by {self.changed_by} at {self.changed_at}"


class ManagementTokenQuerySet(models.QuerySet["ManagementToken"]):
    def usable(self, now: datetime | None = None) -> ManagementTokenQuerySet:
        """Not revoked, not expired, and its maker still an active owner of its tenant: a token
        ends with its maker's account, membership or role, whoever changed them and how."""
        now = now or timezone.now()
        maker_owns = Membership.objects.filter(
            user_id=models.OuterRef("created_by_id"), tenant_id=models.OuterRef("tenant_id"),
            role=Membership.Role.OWNER,
        )
        return self.filter(
            models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now),
            models.Exists(maker_owns), revoked_at__isnull=True, created_by__is_active=True,
        )


class ManagementToken(models.Model):
    """A credential for the management API, bound to one tenant and acting with one role.

    Stored like API keys: only an HMAC under a versioned pepper (``tenants.management_tokens``).
    It works only while its maker is an active owner of the tenant (``usable``).
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    name = models.CharField(max_length=100)
    role = models.CharField(
        max_length=16, choices=Membership.Role.choices, default=Membership.Role.BILLING
    )
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    pepper_version = models.PositiveSmallIntegerField(editable=False)
    prefix = models.CharField(max_length=24, editable=False)
    last_four = models.CharField(max_length=4, editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    objects = ManagementTokenQuerySet.as_manager()

    class Meta:
        db_table = "portal_managementtoken"  # made by the portal app; the data stays put
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.masked})"

    @property
    def masked(self) -> str:
        return f"{self.prefix}…{self.last_four}"


class StaffGrantQuerySet(models.QuerySet["StaffGrant"]):
    def active(self, now: datetime | None = None) -> StaffGrantQuerySet:
        now = now or timezone.now()
        return self.filter(revoked_at__isnull=True, expires_at__gt=now,
                           user__is_active=True, user__is_staff=True)


class StaffGrant(models.Model):
    """Lets one platform staff account act in one tenant with one role, until it expires.

    Being staff gives no access to any tenant's data: support work in a tenant needs a grant,
    made in the admin by someone holding ``tenants.add_staffgrant``, with a reason on record.
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                             related_name="staff_grants")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="staff_grants")
    role = models.CharField(max_length=16, choices=Membership.Role.choices,
                            default=Membership.Role.BILLING)
    reason = models.CharField(max_length=300)
    granted_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, editable=False,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = StaffGrantQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.user} as {self.role} in {self.tenant} until {self.expires_at:%Y-%m-%d %H:%M}"

    def clean(self) -> None:
        if self.user_id and not self.user.is_staff:
            raise ValidationError({"user": "Only staff accounts get grants; invite anyone else."})
        if self.expires_at and self.expires_at <= timezone.now():
            raise ValidationError({"expires_at": "The expiry must be in the future."})


class InvitationQuerySet(models.QuerySet["Invitation"]):
    def pending(self, now: datetime | None = None) -> InvitationQuerySet:
        now = now or timezone.now()
        return self.filter(accepted_at__isnull=True, revoked_at__isnull=True,
                           expires_at__gt=now)


class Invitation(models.Model):
    """A single-use, expiring offer of a membership, sent by email (``tenants.invitations``).

    Only a hash of the link's secret is stored; the link itself exists only in the email.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField()
    role = models.CharField(max_length=16, choices=Membership.Role.choices,
                            default=Membership.Role.MEMBER)
    secret_hash = models.CharField(max_length=64, unique=True, editable=False)
    invited_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                    on_delete=models.SET_NULL, related_name="+")
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = InvitationQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.email} to {self.tenant} as {self.role}"


# --- enterprise sign-in: identity providers (tenants.oidc) and client certificates (tenants.mtls)

# Asymmetric algorithms only. HS* would let anyone holding the public JWKS forge tokens if a
# verifier ever used a public key as an HMAC secret; "none" is never a signature.
SIGNING_ALGORITHMS = (
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA",
)


def _default_algorithms() -> list[str]:
    return ["RS256", "ES256"]


def _default_claim_mapping() -> dict[str, str]:
    return {"subject": "sub", "email": "email"}


class IdentityProvider(models.Model):
    """A tenant's OIDC identity provider: bearer tokens for the API, and optional portal SSO.

    The tenant of a token is the tenant of the registration its (issuer, audience) match, never a
    claim in the token, so (issuer, audience) is unique across all tenants.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="identity_providers")
    name = models.CharField(max_length=100)
    issuer = models.URLField(max_length=500, help_text="Exact `iss` value of the tokens.")
    audience = models.CharField(
        max_length=255, help_text="`aud` the tokens must carry for the inference API."
    )
    jwks_url = models.URLField(max_length=500, blank=True, help_text="The provider's JWKS URL.")
    jwks_json = models.JSONField(
        null=True, blank=True, help_text="Uploaded JWKS ({'keys': [...]}) instead of a URL."
    )
    algorithms = models.JSONField(default=_default_algorithms, help_text="Allowed `alg` values.")
    claim_mapping = models.JSONField(
        default=_default_claim_mapping, blank=True,
        help_text="Claim names: subject (who), email; sso_role_claim + sso_roles for SSO roles.",
    )
    api_enabled = models.BooleanField(default=True, help_text="Accept its tokens on the API.")
    # Portal single sign-on (gateway.sso): authorization-code flow with PKCE.
    sso_enabled = models.BooleanField(default=False)
    sso_client_id = models.CharField(max_length=255, blank=True)
    sso_client_secret = models.CharField(max_length=500, blank=True)
    sso_authorization_endpoint = models.URLField(max_length=500, blank=True)
    sso_token_endpoint = models.URLField(max_length=500, blank=True)
    sso_userinfo_endpoint = models.URLField(max_length=500, blank=True)
    sso_default_role = models.CharField(max_length=16, default="member")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant", "name"]
        constraints = [
            models.UniqueConstraint(fields=["issuer", "audience"], name="one_idp_per_iss_aud"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.issuer})"

    def clean(self) -> None:
        errors: dict[str, str] = {}
        algs = self.algorithms if isinstance(self.algorithms, list) else []
        if not algs or any(a not in SIGNING_ALGORITHMS for a in algs):
            errors["algorithms"] = f"Choose from {', '.join(SIGNING_ALGORITHMS)}."
        if bool(self.jwks_url) == bool(self.jwks_json):
            errors["jwks_url"] = "Give either a JWKS URL or an uploaded JWKS, not both."
        if self.jwks_json and not isinstance(self.jwks_json.get("keys"), list):
            errors["jwks_json"] = "A JWKS is an object with a 'keys' list."
        if self.sso_default_role not in Membership.Role.values:
            errors["sso_default_role"] = f"One of {', '.join(Membership.Role.values)}."
        if errors:
            raise ValidationError(errors)


class ClientCertificate(models.Model):
    """A client certificate (by SHA-256 fingerprint of its DER) bound to one tenant (mTLS)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="client_certificates")
    name = models.CharField(max_length=100)
    fingerprint_sha256 = models.CharField(
        max_length=64, unique=True, help_text="64 lowercase hex digits, no colons."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["tenant", "name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.fingerprint_sha256[:16]}…)"

    def clean(self) -> None:
        fingerprint = normalize_fingerprint(self.fingerprint_sha256)
        if fingerprint is None:
            raise ValidationError({"fingerprint_sha256": "Not a SHA-256 fingerprint."})
        self.fingerprint_sha256 = fingerprint


class TenantFallback(models.Model):
    """A tenant's own fallback order for one public model name, tried before the route's."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="fallbacks")
    model = models.CharField(max_length=200)
    fallbacks = models.JSONField(default=list)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model"]
        constraints = [models.UniqueConstraint(fields=["tenant", "model"],
                                               name="tenant_fallback_once")]

    def __str__(self) -> str:
        return f"{self.tenant.slug}: {self.model} -> {', '.join(self.fallbacks)}"

    def clean(self) -> None:
        check_model_names(self.fallbacks, "fallbacks", exclude=self.model)


from tenants.budget_models import Budget, Project  # noqa: E402  (models of this app)

__all__ += ["Budget", "Project"]
