"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with its status.

Every refusal the API makes is an ``ApiError`` raised from wherever it is found (parsing, auth,
routing, admission) and turned into one response by the consumer, so no path can answer a 500
for bad input. The official client maps the status to its exception class (400 -> BadRequest,
404 -> NotFound, 429 -> RateLimit ...) and reads ``code`` from the body.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})
        if retry_after is not None:
            # Whole seconds, rounded up: a client that waits exactly this long must get in.
            self.headers["retry-after"] = str(max(1, math.ceil(retry_after)))

    def payload(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self) -> bytes:
        return json.dumps(self.payload()).encode()


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unknown_parameter(name: str) -> ApiError:
    return ApiError(
        400, f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter"
    )


def unsupported_value(name: str, message: str) -> ApiError:
    return ApiError(400, message, param=name, code="unsupported_value")


def model_not_found(model: str) -> ApiError:
    # OpenAI answers the same for a model that does not exist and one the key may not use, so a
    # key cannot probe which models other tenants have.
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def context_length_exceeded(limit: int, prompt_tokens: int, max_tokens: int | None) -> ApiError:
    asked = f"{prompt_tokens} tokens in the prompt"
    if max_tokens is not None:
        asked += f" and {max_tokens} requested for the completion"
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested {asked}. "
        "Please reduce the length of the messages or the completion.",
        param="messages",
        code="context_length_exceeded",
    )


def rate_limited(
    message: str, *, code: str, retry_after: float | None, headers: Mapping[str, str]
) -> ApiError:
    return ApiError(
        429, message, type="rate_limit_error", code=code, headers=headers, retry_after=retry_after
    )


def unavailable(message: str, *, retry_after: float = 1.0, code: str = "unavailable") -> ApiError:
    return ApiError(503, message, type="server_error", code=code, retry_after=retry_after)


def server_error(message: str = "The server had an error processing your request.") -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error")


def method_not_allowed(allowed: str) -> ApiError:
    return ApiError(
        405, f"Method not allowed; use {allowed}.", code="method_not_allowed",
        headers={"allow": allowed},
    )


def payload_too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"Request body is larger than {limit} bytes.", code="request_too_large"
    )
