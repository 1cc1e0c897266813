"""Routes (platform staff) and a tenant's own fallback orders (its owners), at /api/routes/ and
/api/tenants/{slug}/fallbacks/ (docs/adr/0024-routes-and-fairness-across-pools.md)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import transaction
from django.db.models import QuerySet
from rest_framework import serializers, viewsets
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import SAFE_METHODS

from catalog.models import Pool, Route, RouteTarget, check_model_names
from gateway.api import access
from gateway.api.views.base import ReadForMembersWriteWithPermission, TenantScoped
from tenants.models import TenantFallback


class RouteTargetSerializer(serializers.ModelSerializer[RouteTarget]):
    pool = serializers.SlugRelatedField(slug_field="name", queryset=Pool.objects.all())

    class Meta:
        model = RouteTarget
        fields = ["pool", "weight", "priority"]


def _names(value: Any, exclude: str = "") -> list[str]:
    try:
        check_model_names(value, "fallbacks", exclude=exclude)
    except DjangoValidationError as exc:
        raise ValidationError(exc.message_dict) from None
    return list(value)


class RouteSerializer(serializers.ModelSerializer[Route]):
    """A route as staff see it: its targets, written with it in one transaction."""

    targets = RouteTargetSerializer(many=True)

    class Meta:
        model = Route
        fields = ["id", "name", "targets", "retries", "fallbacks", "enabled", "created_at"]
        read_only_fields = ["id", "created_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        name = str(attrs.get("name") or getattr(self.instance, "name", ""))
        if "fallbacks" in attrs:
            attrs["fallbacks"] = _names(attrs["fallbacks"], exclude=name)
        pools = [t["pool"].name for t in attrs.get("targets", [])]
        if len(set(pools)) != len(pools):
            raise ValidationError({"targets": ["Each pool at most once."]})
        return attrs

    def create(self, validated: dict[str, Any]) -> Route:
        targets = validated.pop("targets", [])
        with transaction.atomic():
            route = Route.objects.create(**validated)
            RouteTarget.objects.bulk_create(RouteTarget(route=route, **t) for t in targets)
        return route

    def update(self, route: Route, validated: dict[str, Any]) -> Route:
        targets = validated.pop("targets", None)
        with transaction.atomic():
            for field, value in validated.items():
                setattr(route, field, value)
            route.save()
            if targets is not None:  # the list replaces the old one
                route.targets.all().delete()
                RouteTarget.objects.bulk_create(RouteTarget(route=route, **t) for t in targets)
        return route


class PublicRouteSerializer(serializers.ModelSerializer[Route]):
    """A route as a tenant sees it: its name and fallbacks, not the pools behind it."""

    class Meta:
        model = Route
        fields = ["name", "fallbacks", "enabled"]
        read_only_fields = fields


class RouteViewSet(viewsets.ModelViewSet[Route]):
    """Routes: readable by any tenant member (name and fallbacks), written by platform staff
    with the tenants.*_route permissions."""

    permission_classes = [ReadForMembersWriteWithPermission]
    platform_model = Route
    serializer_class = RouteSerializer

    def get_queryset(self) -> QuerySet[Route]:
        return Route.objects.prefetch_related("targets__pool").order_by("name")

    def _staff(self) -> bool:
        method = "GET" if self.request.method in SAFE_METHODS else self.request.method
        return access.has_platform_perm(self.request, Route, method)

    def get_serializer_class(self) -> type[serializers.ModelSerializer[Route]]:
        if getattr(self, "swagger_fake_view", False) or self._staff():
            return RouteSerializer
        return PublicRouteSerializer


class TenantFallbackSerializer(serializers.ModelSerializer[TenantFallback]):
    class Meta:
        model = TenantFallback
        fields = ["id", "model", "fallbacks", "updated_at"]
        read_only_fields = ["id", "updated_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        model = str(attrs.get("model") or getattr(self.instance, "model", ""))
        if "fallbacks" in attrs:
            attrs["fallbacks"] = _names(attrs["fallbacks"], exclude=model)
        tenant = self.context["tenant"]
        taken = TenantFallback.objects.filter(tenant=tenant, model=model)
        if self.instance is not None:
            taken = taken.exclude(pk=self.instance.pk)
        if taken.exists():
            raise ValidationError({"model": ["This model already has a fallback order."]})
        return attrs


class TenantFallbackViewSet(viewsets.ModelViewSet[TenantFallback], TenantScoped[TenantFallback]):
    """The tenant's own fallback order per model, tried before the route's: read by owners and
    members, written by owners."""

    capability = "fallbacks"
    write_capability = "manage_fallbacks"
    serializer_class = TenantFallbackSerializer

    def get_queryset(self) -> QuerySet[TenantFallback]:
        if self.fake():
            return TenantFallback.objects.none()
        return TenantFallback.objects.filter(tenant=self.tenant).order_by("model")

    def perform_create(self, serializer: Any) -> None:
        serializer.save(tenant=self.tenant)
