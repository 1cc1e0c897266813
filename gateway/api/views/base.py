"""Permissions and the base class of every tenant-scoped viewset."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import permissions, viewsets
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request

from gateway.api import access
from gateway.portal import roles
from tenants.models import ApiKey

# Not ``format``: DRF reads that one for content negotiation.
FILE_PARAM = OpenApiParameter("file", str, enum=["csv", "xlsx"],
                              description="Download as a file; absent = JSON.")
TENANT_PARAM = OpenApiParameter("tenant", str, OpenApiParameter.PATH, description="Tenant slug.")


class IsPlatformAdmin(permissions.BasePermission):
    def has_permission(self, request: Request, view: Any) -> bool:
        return access.is_admin(request)


class ReadForMembersWriteForAdmins(permissions.BasePermission):
    def has_permission(self, request: Request, view: Any) -> bool:
        if request.method in permissions.SAFE_METHODS:
            ids = access.tenant_ids(request)
            return ids is None or bool(ids)
        return access.is_admin(request)


@extend_schema(parameters=[TENANT_PARAM])
class TenantScoped(viewsets.GenericViewSet):
    """Resolves ``self.tenant`` and ``self.role`` before any handler runs."""

    capability = "usage"
    write_capability: str | None = None
    admin_writes = False  # writes need a platform admin even if the role could read

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        write = request.method not in permissions.SAFE_METHODS
        capability = (self.write_capability or self.capability) if write else self.capability
        self.tenant, self.role = access.resolve(request, kwargs["tenant"], capability)
        if write and self.admin_writes and not access.is_admin(request):
            raise PermissionDenied("Only platform admins change this.")

    def get_serializer_context(self) -> dict[str, Any]:
        return {**super().get_serializer_context(), "tenant": getattr(self, "tenant", None)}

    def fake(self) -> bool:
        return getattr(self, "swagger_fake_view", False)

    def own_key_ids(self) -> list[int] | None:
        if roles.can(self.role, "all_usage"):
            return None
        return list(self.visible_keys().values_list("id", flat=True))

    def visible_keys(self) -> QuerySet[ApiKey]:
        keys = ApiKey.objects.filter(tenant=self.tenant)
        if not roles.can(self.role, "all_keys"):
            keys = keys.filter(created_by_id=self.request.user.pk or -1)
        return keys
