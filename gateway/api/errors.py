"""Errors in the OpenAI shape, like the inference API: {"error": {message, type, param, code}}."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_handler

TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
    429: "rate_limit_error",
}


def _first(detail: Any, path: str = "") -> tuple[str | None, str, str | None]:
    """(param, message, code) of the first error in a DRF detail structure."""
    if isinstance(detail, dict) and detail:
        name, value = next(iter(detail.items()))
        param = name if name not in ("non_field_errors", "detail") else None
        sub_param, message, code = _first(value, path)
        return param or sub_param, message, code
    if isinstance(detail, list) and detail:
        return _first(detail[0], path)
    return None, str(detail), getattr(detail, "code", None)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, DjangoValidationError):  # model.full_clean() inside a view
        exc = exceptions.ValidationError(getattr(exc, "message_dict", None) or exc.messages)
    response = drf_handler(exc, context)
    if response is None:
        return None
    param, message, code = _first(response.data)
    response.data = {"error": {
        "message": message, "type": TYPES.get(response.status_code, "api_error"),
        "param": param, "code": code,
    }}
    return response


def bad_request(message: str, param: str | None = None) -> Response:
    return Response({"error": {"message": message, "type": "invalid_request_error",
                               "param": param, "code": "invalid"}},
                    status=status.HTTP_400_BAD_REQUEST)
