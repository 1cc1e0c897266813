"""Members of a tenant, invitations to join it, and its quotas."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from catalog.visibility import models_for
from gateway.api import access
from gateway.api import serializers as s
from gateway.api.views.base import TenantScoped
from tenants import invitations, membership
from tenants.limits import effective_limits
from tenants.models import Invitation, Membership, Quota


class MembershipViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin,
                        mixins.UpdateModelMixin, mixins.DestroyModelMixin,
                        TenantScoped[Membership]):
    """Members of the tenant (owners). People join by invitation (``invitations/``). The last
    owner cannot be removed or demoted."""

    capability = "members"
    serializer_class = s.MembershipSerializer
    http_method_names = ["get", "patch", "delete", "head", "options"]

    def get_queryset(self) -> QuerySet[Membership]:
        if self.fake():
            return Membership.objects.none()
        return Membership.objects.filter(tenant=self.tenant).select_related("user").order_by("id")

    def perform_update(self, serializer: Any) -> None:
        access.refuse_under_grant(self.request, self.tenant, "change memberships")
        role = serializer.validated_data.get("role", serializer.instance.role)
        membership.change_role(serializer.instance, role)

    def perform_destroy(self, instance: Membership) -> None:
        access.refuse_under_grant(self.request, self.tenant, "remove members")
        membership.remove(instance)


class InvitationViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin,
                        mixins.CreateModelMixin, mixins.DestroyModelMixin,
                        TenantScoped[Invitation]):
    """Pending invitations (owners). POST emails a single-use link; DELETE revokes."""

    capability = "members"
    serializer_class = s.InvitationSerializer

    def get_queryset(self) -> QuerySet[Invitation]:
        if self.fake():
            return Invitation.objects.none()
        return Invitation.objects.filter(tenant=self.tenant).pending().select_related(
            "invited_by")

    def perform_create(self, serializer: Any) -> None:
        request = self.request
        access.refuse_under_grant(request, self.tenant, "invite members")
        data = serializer.validated_data
        serializer.instance = invitations.invite(
            self.tenant, data["email"], data.get("role", Membership.Role.MEMBER),
            access.user_for_audit(request),
            lambda secret: request.build_absolute_uri(reverse("portal:invitation",
                                                              args=[secret])))

    def perform_destroy(self, instance: Invitation) -> None:
        invitations.revoke(instance)


class QuotaViewSet(viewsets.ModelViewSet[Quota], TenantScoped[Quota]):
    """The tenant's quota rows (read by members; written by platform admins) and, at
    .../effective/, the limits that apply per model after defaults and overrides."""

    capability = "quotas"
    platform_model = Quota  # limits are set by the platform, not by the tenant
    serializer_class = s.QuotaSerializer

    def get_queryset(self) -> QuerySet[Quota]:
        if self.fake():
            return Quota.objects.none()
        return Quota.objects.filter(tenant=self.tenant).select_related("model").order_by("id")

    def perform_create(self, serializer: Any) -> None:
        quota = Quota(tenant=self.tenant, **serializer.validated_data)
        quota.full_clean()
        serializer.save(tenant=self.tenant)

    def perform_update(self, serializer: Any) -> None:
        quota = serializer.instance
        for field, value in serializer.validated_data.items():
            setattr(quota, field, value)
        quota.full_clean()
        serializer.save()

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    @action(detail=False)
    def effective(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = {"default": effective_limits(self.tenant).as_dict()}
        for model in models_for(self.tenant):
            data[model.name] = effective_limits(self.tenant, model).as_dict()
        return Response(data)
