"""Permissions and the base class of every tenant-scoped viewset."""

from __future__ import annotations

from typing import Any, TypeVar

from django.db.models import Model
from django.http import Http404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import permissions, viewsets
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request

from gateway.api import access
from tenants import roles
from tenants.models import ApiKey, ApiKeyQuerySet, Tenant

# Not ``format``: DRF reads that one for content negotiation.
_M = TypeVar("_M", bound=Model)

FILE_PARAM = OpenApiParameter("file", str, enum=["csv", "xlsx"],
                              description="Download as a file; absent = JSON.")
TENANT_PARAM = OpenApiParameter("tenant", str, OpenApiParameter.PATH, description="Tenant slug.")


class PlatformPermission(permissions.BasePermission):
    """The Django model permission matching the method on ``view.platform_model``."""

    def has_permission(self, request: Request, view: Any) -> bool:
        return access.has_platform_perm(request, view.platform_model)


class ReadForMembersWriteWithPermission(permissions.BasePermission):
    """Reads: anyone acting in some tenant (the view narrows what they see), or holding the
    view permission. Writes: the matching Django model permission."""

    def has_permission(self, request: Request, view: Any) -> bool:
        if request.method in permissions.SAFE_METHODS and access.tenant_ids(request):
            return True
        return access.has_platform_perm(request, view.platform_model)


@extend_schema(parameters=[TENANT_PARAM])
class TenantScoped(viewsets.GenericViewSet[_M]):
    """Resolves ``self.tenant`` and ``self.role`` before any handler runs."""

    tenant: Tenant
    # None only for a platform write by staff holding the model's Django permission.
    role: str | None

    capability = "usage"
    write_capability: str | None = None
    # Set on viewsets whose writes are platform actions (the caller's tenant role is not
    # enough): they need this model's Django permission instead.
    platform_model: type[Model] | None = None

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        write = request.method not in permissions.SAFE_METHODS
        if write and self.platform_model is not None:
            self._platform_write(request, kwargs["tenant"])
            return
        capability = (self.write_capability or self.capability) if write else self.capability
        self.tenant, self.role = access.resolve(request, kwargs["tenant"], capability)

    def _platform_write(self, request: Request, slug: str) -> None:
        assert self.platform_model is not None
        if access.has_platform_perm(request, self.platform_model):
            tenant = Tenant.objects.filter(slug=slug).first()
            if tenant is None:
                raise Http404("No such tenant.")  # the same 404 as access.resolve's
            self.tenant, self.role = tenant, None
            return
        self.tenant, self.role = access.resolve(request, slug, self.capability)
        raise PermissionDenied("Only platform staff with the matching permission change this.")

    def get_serializer_context(self) -> dict[str, Any]:
        return {**super().get_serializer_context(), "tenant": getattr(self, "tenant", None)}

    def fake(self) -> bool:
        return getattr(self, "swagger_fake_view", False)

    def own_key_ids(self) -> list[int] | None:
        if roles.can(self.role, "all_usage"):
            return None
        return list(self.visible_keys().values_list("id", flat=True))

    def visible_keys(self) -> ApiKeyQuerySet:
        keys = ApiKey.objects.filter(tenant=self.tenant)
        if not roles.can(self.role, "all_keys"):
            keys = keys.filter(created_by_id=self.request.user.pk or -1)
        return keys
