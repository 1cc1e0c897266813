"""The tenant's management tokens: list with expiry and last use, revoke. Owners only.

Tokens are made in the portal, where the plaintext can be shown once to a person.
"""

from __future__ import annotations

from django.db.models import QuerySet
from django.utils import timezone
from rest_framework import mixins

from gateway.api import serializers as s
from gateway.api.views.base import TenantScoped
from tenants.models import ManagementToken


class ManagementTokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin,
                             mixins.DestroyModelMixin, TenantScoped[ManagementToken]):
    """Management tokens. DELETE revokes."""

    capability = "tokens"
    serializer_class = s.ManagementTokenSerializer

    def get_queryset(self) -> QuerySet[ManagementToken]:
        if self.fake():
            return ManagementToken.objects.none()
        return ManagementToken.objects.filter(tenant=self.tenant).select_related("created_by")

    def get_serializer_context(self) -> dict[str, object]:
        context = super().get_serializer_context()
        if not self.fake() and hasattr(self, "tenant"):
            context["usable"] = set(ManagementToken.objects.filter(tenant=self.tenant).usable()
                                    .values_list("pk", flat=True))
        return context

    def perform_destroy(self, instance: ManagementToken) -> None:
        ManagementToken.objects.filter(pk=instance.pk, revoked_at__isnull=True).update(
            revoked_at=timezone.now())
