"""The content-logging opt-in and its audit trail."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from gateway.api import access
from gateway.api import serializers as s
from gateway.api.schema import OneObjectSchema
from gateway.api.views.base import TenantScoped
from tenants.content_logging import switch
from tenants.models import ContentLoggingChange


# Any: no model behind it; its serializer shapes the tenant's switch and its history.
class ContentLoggingViewSet(TenantScoped[Any]):
    """The content-logging opt-in (owners) and who switched it when."""

    capability = "content_logging"
    serializer_class = s.ContentLoggingSerializer
    schema = OneObjectSchema()  # list answers the switch and its history, not a page

    def _state(self) -> dict[str, Any]:
        changes = ContentLoggingChange.objects.filter(tenant=self.tenant).select_related(
            "changed_by")[:100]
        return {"enabled": self.tenant.content_logging, "changes": changes,
                "retention_days": getattr(self.tenant, "content_retention_days", None)}

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return Response(s.ContentLoggingSerializer(self._state()).data)

    @extend_schema(request=s.ContentLoggingSerializer, responses=s.ContentLoggingSerializer)
    @action(detail=False, methods=["put"], url_path="set")
    def set_enabled(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        # The tenant's own owner decides: not support staff acting under a grant.
        access.refuse_under_grant(request, self.tenant, "switch content logging")
        body = s.ContentLoggingSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        switch(self.tenant, body.validated_data["enabled"], access.user_for_audit(request),
               request.META.get("REMOTE_ADDR"))
        return Response(s.ContentLoggingSerializer(self._state()).data)
