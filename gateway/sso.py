"""Portal single sign-on with a tenant's own OIDC provider (mozilla-django-oidc).

Configured **per tenant**, on its ``IdentityProvider`` (``sso_enabled``, client id/secret,
endpoints); there is no global provider. Flow: ``/sso/<provider id>/login/`` remembers the
provider in the session and redirects to it (authorization code + PKCE + nonce + state, all from
the library); ``/sso/callback/`` is the library's callback view, which calls
``TenantOIDCBackend``. The backend:

- verifies the ID token with ``tenants.oidc.verify_token`` (signature, alg allow-list, ``iss``,
  ``aud`` = client id, ``exp``, nonce), stricter than the library's default, which skips ``aud``;
- maps the identity with ``map_sso_user``: the user is keyed by (provider, subject), **never
  matched to an existing account by email**, so tenant B's provider cannot log in as tenant A's
  owner by asserting their address; the membership is in the provider's tenant only, with the
  role from the claim mapping (``sso_role_claim`` + ``sso_roles``) or ``sso_default_role``;
- on a user's first sign-in, accepts that tenant's pending invitations to the email the
  provider asserts (an invitation never lowers the role; another tenant's invitations are left
  alone, since this provider proves nothing to them). An invitation link opened before signing
  in is accepted as well (``gateway.portal.views.invitations``).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import SuspiciousOperation
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import path, reverse
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.views import (
    OIDCAuthenticationCallbackView,
    OIDCAuthenticationRequestView,
)

from tenants import invitations, oidc
from tenants.models import IdentityProvider, Membership, Tenant

log = logging.getLogger(__name__)

SESSION_KEY = "sso_provider_id"
_ROLE_RANK = {Membership.Role.MEMBER: 0, Membership.Role.BILLING: 1, Membership.Role.OWNER: 2}


def sso_providers_for_tenant(tenant: Tenant | int) -> list[IdentityProvider]:
    """The portal's list of a tenant's SSO-enabled providers (for its login buttons)."""
    return list(IdentityProvider.objects.filter(
        tenant_id=getattr(tenant, "pk", tenant), sso_enabled=True))


def sso_login_url(provider: IdentityProvider) -> str:
    return reverse("sso:login", args=[provider.pk])


def _username(provider: IdentityProvider, subject: str) -> str:
    return f"sso-{provider.pk}-{hashlib.sha256(subject.encode()).hexdigest()[:32]}"


def role_from_claims(provider: IdentityProvider, claims: dict[str, Any]) -> str:
    """The highest role any of the user's claim values maps to, else the default role."""
    mapping = provider.claim_mapping or {}
    values = claims.get(mapping.get("sso_role_claim", ""), [])
    values = [values] if isinstance(values, str) else values if isinstance(values, list) else []
    roles = [mapping.get("sso_roles", {}).get(v) for v in values if isinstance(v, str)]
    valid = [r for r in roles if r in _ROLE_RANK]
    return max(valid, key=_ROLE_RANK.__getitem__) if valid else provider.sso_default_role


def map_sso_user(provider: IdentityProvider, claims: dict[str, Any]) -> AbstractBaseUser:
    """The local user and membership for an identity the provider vouched for."""
    subject = oidc.subject_of(claims, provider)
    email_claim = (provider.claim_mapping or {}).get("email", "email")
    claimed = claims.get(email_claim)
    email = claimed if isinstance(claimed, str) else ""
    role = role_from_claims(provider, claims)
    user_model = get_user_model()
    with transaction.atomic():
        user, created = user_model.objects.get_or_create(
            username=_username(provider, subject), defaults={"email": email}
        )
        if created:
            user.set_unusable_password()
            user.save(update_fields=["password"])
        elif email and user.email != email:
            user.email = email
            user.save(update_fields=["email"])
        membership, made = Membership.objects.get_or_create(
            user=user, tenant_id=provider.tenant_id, defaults={"role": role}
        )
        if created and email:  # a first sign-in takes up this tenant's invitations to it
            invitations.accept_pending_for_identity(provider.tenant_id, email, user)
        # The provider is the source of truth for roles only when it sends a role claim.
        if not made and (provider.claim_mapping or {}).get("sso_role_claim") and \
                membership.role != role:
            membership.role = role
            membership.save(update_fields=["role"])
    return user


# mozilla-django-oidc ships no type information: its classes are Any to mypy.
class TenantOIDCBackend(OIDCAuthenticationBackend):  # type: ignore[misc]
    """mozilla-django-oidc's backend, configured from the provider chosen at login."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The library reads one global provider from settings here; ours comes per request.
        self.UserModel = get_user_model()
        self.provider: IdentityProvider | None = None

    def authenticate(self, request: HttpRequest | None, **kwargs: Any) -> Any:
        provider_id = request.session.get(SESSION_KEY) if request is not None else None
        provider = IdentityProvider.objects.filter(pk=provider_id, sso_enabled=True).first() \
            if provider_id else None
        if provider is None:
            return None
        self.provider = provider
        self.OIDC_OP_TOKEN_ENDPOINT = provider.sso_token_endpoint
        self.OIDC_OP_USER_ENDPOINT = provider.sso_userinfo_endpoint
        self.OIDC_OP_JWKS_ENDPOINT = provider.jwks_url or None
        self.OIDC_RP_CLIENT_ID = provider.sso_client_id
        self.OIDC_RP_CLIENT_SECRET = provider.sso_client_secret
        return super().authenticate(request, **kwargs)

    def verify_token(self, token: str, **kwargs: Any) -> dict[str, Any]:
        assert self.provider is not None
        try:
            return oidc.verify_token(token, self.provider, audience=self.provider.sso_client_id,
                                     nonce=kwargs.get("nonce"))
        except oidc.TokenRejected as exc:
            raise SuspiciousOperation(f"ID token rejected: {exc}") from exc

    def get_or_create_user(self, access_token: str, id_token: str,
                           payload: dict[str, Any]) -> AbstractBaseUser | None:
        assert self.provider is not None
        claims = dict(payload)
        if self.provider.sso_userinfo_endpoint:
            userinfo = self.get_userinfo(access_token, id_token, payload)
            if userinfo.get("sub") != payload.get("sub"):  # OIDC core 5.3.2
                raise SuspiciousOperation("userinfo subject differs from the ID token's")
            claims.update({k: v for k, v in userinfo.items() if k not in ("iss", "aud")})
        try:
            return map_sso_user(self.provider, claims)
        except oidc.TokenRejected as exc:
            raise SuspiciousOperation(str(exc)) from exc


class TenantSSOLoginView(OIDCAuthenticationRequestView):  # type: ignore[misc]  # untyped, as above
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super(OIDCAuthenticationRequestView, self).__init__(*args, **kwargs)

    def get(self, request: HttpRequest, provider_id: int) -> HttpResponse:
        provider = IdentityProvider.objects.filter(pk=provider_id, sso_enabled=True).first()
        if provider is None or not provider.sso_authorization_endpoint:
            raise Http404("no such sign-in provider")
        self.OIDC_OP_AUTH_ENDPOINT = provider.sso_authorization_endpoint
        self.OIDC_RP_CLIENT_ID = provider.sso_client_id
        request.session[SESSION_KEY] = provider.pk
        response: HttpResponse = super().get(request)  # the library's redirect to the provider
        return response


app_name = "sso"
urlpatterns = [
    path("<int:provider_id>/login/", TenantSSOLoginView.as_view(), name="login"),
    path("callback/", OIDCAuthenticationCallbackView.as_view(), name="callback"),
]
