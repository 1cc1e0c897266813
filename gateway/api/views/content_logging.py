"""The tenant's content-storing opt-ins (content logging, the response cache) and their audit
trail: owners switch them, nobody else, and never staff acting under a grant."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from gateway.api import access
from gateway.api import serializers as s
from gateway.api.schema import OneObjectSchema
from gateway.api.views.base import TenantScoped
from tenants.content_logging import Setting, switch
from tenants.models import ContentLoggingChange


# Any: no model behind it; its serializer shapes the tenant's switch and its history.
class _OptInViewSet(TenantScoped[Any]):
    """One opt-in: ``list`` answers the switch and who switched it when, ``set`` switches it."""

    setting: str
    serializer_class: type[serializers.Serializer[Any]]
    schema = OneObjectSchema()  # list answers the switch and its history, not a page

    def _state(self) -> dict[str, Any]:
        changes = ContentLoggingChange.objects.filter(
            tenant=self.tenant, setting=self.setting).select_related("changed_by")[:100]
        return {"enabled": getattr(self.tenant, self.setting), "changes": changes,
                "retention_days": getattr(self.tenant, "content_retention_days", None)}

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return Response(self.serializer_class(self._state()).data)

    # One action for both opt-ins, so their rule (owners only, never under a grant) cannot
    # drift apart; the schema takes each subclass's serializer_class for the body and answer.
    @action(detail=False, methods=["put"], url_path="set")
    def set_enabled(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        # The tenant's own owner decides: not support staff acting under a grant.
        access.refuse_under_grant(request, self.tenant, f"switch the {self.setting}")
        body = self.serializer_class(data=request.data)
        body.is_valid(raise_exception=True)
        switch(self.tenant, body.validated_data["enabled"], access.user_for_audit(request),
               request.META.get("REMOTE_ADDR"), setting=self.setting)
        return Response(self.serializer_class(self._state()).data)


class ContentLoggingViewSet(_OptInViewSet):
    """The content-logging opt-in (owners) and who switched it when."""

    capability = "content_logging"
    setting = Setting.CONTENT_LOGGING
    serializer_class = s.ContentLoggingSerializer


class ResponseCacheViewSet(_OptInViewSet):
    """The response-cache opt-in (owners): repeated deterministic requests (temperature 0 or a
    seed) answered from this tenant's own exact-match cache, and who switched it when."""

    capability = "response_cache"
    setting = Setting.RESPONSE_CACHE
    serializer_class = s.ResponseCacheSerializer
