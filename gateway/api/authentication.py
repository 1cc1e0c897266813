"""Management tokens as DRF authentication.

A token authenticates as a ``TokenUser`` that is never staff and belongs to no membership: what
it may do comes only from the token's own tenant and role (``gateway.api.access``), so a token
made by a platform admin or by someone in several tenants still reaches exactly one tenant.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from tenants.management_tokens import looks_like_token, verify
from tenants.models import ManagementToken


class TokenUser:
    is_authenticated = True
    is_anonymous = False
    is_staff = False
    is_superuser = False
    is_active = True
    pk = id = None

    def __init__(self, token: ManagementToken) -> None:
        self.token = token
        self.username = f"token:{token.prefix}"

    def __str__(self) -> str:
        return self.username

    def get_username(self) -> str:
        return self.username


class ManagementTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[Any, ManagementToken] | None:
        header = authentication.get_authorization_header(request).decode(errors="replace")
        scheme, _, credential = header.partition(" ")
        if scheme.lower() != "bearer" or not looks_like_token(credential.strip()):
            return None  # not ours: session auth may still apply
        token = verify(credential.strip())
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid, revoked or expired management token.")
        return TokenUser(token), token

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


# drf-spectacular leaves the extension's __init_subclass__ (its registry hook) unannotated.
class ManagementTokenScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    target_class = ManagementTokenAuthentication
    name = "managementToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer",
                "description": "A management token from the portal (API tokens page)."}
