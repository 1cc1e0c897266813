"""API keys of a tenant: create (shown once), list, revoke, rotate."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from gateway.api import access
from gateway.api import serializers as s
from gateway.api.views.base import TenantScoped
from tenants import roles
from tenants.api_keys import KeyNotRotatable, issue_key, rotate_key
from tenants.models import ApiKey


class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin,
                    mixins.DestroyModelMixin, TenantScoped[ApiKey]):
    """API keys. DELETE revokes; POST .../rotate/ issues a successor with a grace period."""

    capability = "keys"
    serializer_class = s.ApiKeySerializer

    def get_queryset(self) -> QuerySet[ApiKey]:
        if self.fake():
            return ApiKey.objects.none()
        keys = self.visible_keys().prefetch_related("allowed_models").select_related("created_by")
        if self.request.query_params.get("active") in ("1", "true"):
            keys = keys.usable()
        return keys

    @extend_schema(request=s.ApiKeySerializer, responses={201: s.NewApiKeySerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        access.refuse_under_grant(request, self.tenant, "issue API keys")
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        models = data.pop("allowed_models", [])
        key, plaintext = issue_key(self.tenant, data.pop("name"), allowed_models=models,
                                   created_by=access.user_for_audit(request), **data)
        return _new_key_response(key, plaintext)

    def perform_destroy(self, instance: ApiKey) -> None:
        instance.revoke()

    @extend_schema(request=s.RotateSerializer, responses={201: s.NewApiKeySerializer})
    @action(detail=True, methods=["post"])
    def rotate(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        access.refuse_under_grant(request, self.tenant, "issue API keys")
        old = self.get_object()
        form = s.RotateSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        try:
            new, plaintext = rotate_key(
                old, timedelta(seconds=form.validated_data["grace_seconds"]),
                created_by=access.user_for_audit(request))
        except KeyNotRotatable as exc:
            raise ValidationError({"detail": str(exc)}) from None
        return _new_key_response(new, plaintext)


    @extend_schema(request=None, responses={200: s.ApiKeySerializer})
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Lift a spend alert's hard cap from a key that is over budget (owners only)."""
        key = self.get_object()
        if not roles.can(self.role, "manage_budgets"):
            raise PermissionDenied("Only an owner resumes a key that is over budget.")
        key.resume()
        return Response(s.ApiKeySerializer(key, context=self.get_serializer_context()).data)


def _new_key_response(key: ApiKey, plaintext: str) -> Response:
    data = s.NewApiKeySerializer(key).data
    data["key"] = plaintext
    return Response(data, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})
