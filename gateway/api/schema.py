"""OpenAPI post-processing: every management operation documents its error answers.

drf-spectacular lists only the success status, but every view can also answer 400 (bad body
or query), 401 (no credential), 403 (role), 404 (another tenant's slug, an unknown id), 405 and
the body limits' 408 / 413 (``gateway.inference.bodylimit``), all with the OpenAI-shaped
error body of ``gateway.api.errors``. Clients generated from the document (and schemathesis'
status-code check) need them listed.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.openapi import AutoSchema

ERRORS = {
    "400": "Invalid request",
    "401": "Missing or invalid credential",
    "403": "Not allowed for this role",
    "404": "Not found (or another tenant's)",
    "405": "Method not allowed",
    "408": "The request body did not arrive in time",
    "413": "The request body is too large",
}
ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": "string", "nullable": True},
                       "code": {"type": "string", "nullable": True}}}},
}
# Answers that differ by who asks, as a fuller and a narrower view of one object: the full one
# also satisfies the narrow one, so "oneOf" (exactly one) would reject it; "anyOf" is right.
ANY_OF_COMPONENTS = ("ModelAnswer", "PoolAnswer")
METHODS = ("get", "put", "patch", "post", "delete", "head", "options")
# With ``?file=csv|xlsx`` (views.base.FILE_PARAM) a report view answers the file instead.
FILE_TYPES = ("text/csv", "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet")


def add_error_responses(result: dict[str, Any], generator: Any, request: Any,
                        public: bool) -> dict[str, Any]:
    """drf-spectacular POSTPROCESSING_HOOKS entry."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = ERROR_SCHEMA
    for name in ANY_OF_COMPONENTS:
        if "oneOf" in schemas.get(name, {}):
            schemas[name]["anyOf"] = schemas[name].pop("oneOf")
    body = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for item in result.get("paths", {}).values():
        for method in METHODS:
            if method in item:
                responses = item[method].setdefault("responses", {})
                _add_file_types(item[method], responses)
                for status, why in ERRORS.items():
                    responses.setdefault(status, {"description": why, "content": body})
    return result


def _add_file_types(operation: dict[str, Any], responses: dict[str, Any]) -> None:
    takes_file = any(p.get("name") == "file" and p.get("in") == "query"
                     for p in operation.get("parameters", ()))
    ok = responses.get("200")
    if takes_file and ok is not None:
        content = ok.setdefault("content", {})
        for media in FILE_TYPES:
            content.setdefault(media, {"schema": {"type": "string", "format": "binary"}})


class OneObjectSchema(AutoSchema):
    """For a ``list`` action that answers one object (a report, a switch), not a page."""

    def _is_list_view(self, serializer: Any = None) -> bool:
        return False
