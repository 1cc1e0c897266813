"""The OpenAPI 3 description of the inference API, served at ``GET /v1/openapi.json``.

Written by hand (the consumers are not DRF views) but derived from the parser where it matters:
the request schemas list exactly ``requests.CHAT_FIELDS`` / ``COMPLETION_FIELDS`` with
``additionalProperties: false``, because the parser refuses any other field with a 400
(``tests/test_fuzz_parsers.py`` checks the two stay equal). Every status a consumer can answer is
listed with the OpenAI error body, so a client generator (and schemathesis) knows them all.
The document is public: it names no tenant, model or limit.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from gateway.inference import embeddings as emb
from gateway.inference import requests as rq
from gateway.inference import responses_api as rapi
from gateway.inference.consumers import ApiConsumer
from gateway.inference.requests import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_STOP_SEQUENCES,
    MAX_TOKENS_CEILING,
    ROLES,
)
from gateway.inference.tools import MAX_TOOLS

REF = "#/components/schemas/"
# Statuses every POST endpoint may answer besides 200, and why.
POST_ERRORS = {
    "400": "Invalid request body or parameter",
    "401": "Missing or invalid credential",
    "403": "The tenant is suspended",
    "404": "Unknown model, or no stream to resume",
    "408": "The request body did not arrive in time",
    "409": "A request with this Idempotency-Key is still running",
    "413": "The request body is too large",
    "422": "This Idempotency-Key was used with another body",
    "429": "A rate, concurrency or open-stream limit refused the request (nothing charged)",
    "500": "The generation failed after tokens were sent (not billed beyond them)",
    "503": "Overloaded, or no token could be generated: retry after Retry-After",
    "504": "The generation missed its deadline",
}
GET_ERRORS = {k: POST_ERRORS[k] for k in ("401", "403", "404", "408")}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF + name}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


def _common_properties() -> dict[str, Any]:
    token_count = {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_CEILING}
    return {
        "model": {"type": "string", "minLength": 1, "maxLength": 256},
        "max_tokens": _nullable(token_count),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "stop": _nullable({"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "maxItems": MAX_STOP_SEQUENCES,
             "items": {"type": "string", "minLength": 1}},
        ]}),
        "seed": _nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}),
        "user": _nullable({"type": "string", "maxLength": 256}),
        "safety_identifier": _nullable({"type": "string", "maxLength": 256,
                                        "description": "The end user (preferred to `user`)."}),
        "prompt_cache_key": _nullable({"type": "string", "maxLength": 256, "description":
                                       "Requests sharing a prefix: the same key goes to the "
                                       "same deployment of a route; caching stays within the "
                                       "tenant."}),
        "fallbacks": {"type": "array", "maxItems": 4, "uniqueItems": True,
                      "items": {"type": "string", "minLength": 1}, "description":
                      "Models to fall back to, in order, when this one is overloaded or down "
                      "(the official client sends it with `extra_body`)."},
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({
            "type": "object", "additionalProperties": False,
            "properties": {"include_usage": _nullable({"type": "boolean"})},
            "description": "Only with stream: true.",
        }),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": rq.MAX_N,
                        "description": "Choices; admission reserves n x max_tokens."}),
        "metadata": {"nullable": True, "description": "Accepted and ignored."},
        "store": {"nullable": True, "description": "Accepted and ignored."},
        "service_tier": {"nullable": True, "description": "Accepted and ignored."},
        "ignore_eos": _nullable({"type": "boolean", "description": "vLLM extension."}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({"type": "number", "minimum": 0.01, "maximum": 10,
                                         "description": "vLLM extension."}),
        "min_tokens": _nullable({"type": "integer", "minimum": 0,
                                 "maximum": MAX_TOKENS_CEILING,
                                 "description": "vLLM extension."}),
        "logit_bias": _nullable({
            "type": "object", "maxProperties": rq.MAX_LOGIT_BIAS,
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "description": "Token id (as a string) -> bias."}),
        "response_format": _nullable(_ref("ResponseFormat")),
    }


def _message() -> dict[str, Any]:
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"type": "string", "enum": ["text"]},
                                "text": {"type": "string"}}}
    return {
        "type": "object", "required": ["role"], "additionalProperties": False,
        "description": "content is required unless an assistant message has tool_calls; "
                       "tool messages need tool_call_id.",
        "properties": {
            "role": {"type": "string", "enum": sorted(ROLES)},
            "content": _nullable({"oneOf": [{"type": "string"},
                                            {"type": "array", "items": text_part}]}),
            "name": _nullable({"type": "string"}),
            "tool_calls": _nullable({"type": "array", "items": _ref("ToolCall")}),
            "tool_call_id": _nullable({"type": "string"}),
            "refusal": _nullable({"type": "string"}),
        },
    }


def _tool_schemas() -> dict[str, Any]:
    name = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
    function = {"type": "object", "required": ["name"], "additionalProperties": False,
                "properties": {"name": name, "description": _nullable({"type": "string"}),
                               "parameters": _nullable({"type": "object"}),
                               "strict": _nullable({"type": "boolean"})}}
    return {
        "Tool": {"type": "object", "required": ["type", "function"],
                 "additionalProperties": False,
                 "properties": {"type": {"type": "string", "enum": ["function"]},
                                "function": function}},
        "ToolChoice": {"oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"],
                             "properties": {"name": {"type": "string"}}}}}]},
        "ToolCall": {"type": "object", "required": ["type", "function"], "properties": {
            "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": ["name", "arguments"], "properties": {
                "name": {"type": "string"}, "arguments": {"type": "string"}}}}},
        "ResponseFormat": {"oneOf": [
            {"type": "object", "required": ["type"], "additionalProperties": False,
             "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"],
             "additionalProperties": False, "properties": {
                 "type": {"type": "string", "enum": ["json_schema"]},
                 "json_schema": {"type": "object", "required": ["name"],
                                 "additionalProperties": False, "properties": {
                                     "name": name, "schema": {"type": "object"},
                                     "strict": _nullable({"type": "boolean"}),
                                     "description": _nullable({"type": "string"})}}}}]},
    }


def _request(fields: frozenset[str], extra: dict[str, Any],
             required: list[str]) -> dict[str, Any]:
    props = {k: v for k, v in _common_properties().items() if k in fields}
    props.update(extra)
    assert set(props) == set(fields), set(props) ^ set(fields)  # the parser is the authority
    return {"type": "object", "required": required, "additionalProperties": False,
            "properties": dict(sorted(props.items()))}


def _usage() -> dict[str, Any]:
    count = {"type": "integer", "minimum": 0}
    return {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            "prompt_tokens": count, "completion_tokens": count, "total_tokens": count,
            "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": count}},
        },
    }


def _completion(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"type": "string", "enum": [obj]},
            "created": {"type": "integer"}, "model": {"type": "string"},
            "choices": {"type": "array", "items": choice}, "usage": _ref("Usage"),
            "system_fingerprint": _nullable({"type": "string"}),
        },
    }


def _choice(body: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["index", "finish_reason"], "properties": {
        "index": {"type": "integer"},
        "finish_reason": {"type": "string", "enum": ["stop", "length", "tool_calls"]},
        "logprobs": {"nullable": True, "type": "object",
                     "description": "With logprobs: chat {content: [{token, logprob, bytes, "
                                    "top_logprobs}]}; completions {tokens, token_logprobs, "
                                    "top_logprobs, text_offset}."}, **body}}


def _schemas() -> dict[str, Any]:
    message_out = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["assistant"]},
        "content": _nullable({"type": "string"}),
        "tool_calls": {"type": "array", "items": _ref("ToolCall")},
        "refusal": _nullable({"type": "string"})}}
    model = {"type": "object", "required": ["id", "object", "created", "owned_by"],
             "properties": {"id": {"type": "string"}, "object": {"enum": ["model"]},
                            "created": {"type": "integer"}, "owned_by": {"type": "string"}}}
    return {
        "ChatCompletionRequest": _request(
            CHAT_FIELDS,
            {"messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
             "max_completion_tokens": _nullable(
                 {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_CEILING}),
             "tools": _nullable({"type": "array", "maxItems": MAX_TOOLS,
                                 "items": _ref("Tool")}),
             "tool_choice": _nullable(_ref("ToolChoice")),
             "parallel_tool_calls": _nullable({"type": "boolean"}),
             "logprobs": _nullable({"type": "boolean"}),
             "top_logprobs": _nullable({"type": "integer", "minimum": 0,
                                        "maximum": rq.MAX_TOP_LOGPROBS,
                                        "description": "Needs logprobs: true."})},
            ["model", "messages"]),
        "CompletionRequest": _request(
            COMPLETION_FIELDS,
            {"prompt": {"oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1,
                 "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}}]},
             "logprobs": _nullable({"type": "integer", "minimum": 0,
                                    "maximum": rq.MAX_COMPLETION_LOGPROBS})},
            ["model", "prompt"]),
        "ChatMessage": _message(),
        **_tool_schemas(),
        **_embedding_schemas(),
        **_responses_schemas(),
        # One server-sent event: ``data`` is a chunk (JSON), an error body or ``[DONE]``;
        # ``id`` (``<request id>/<entry>``) is what Last-Event-ID resumes from.
        "StreamEvent": {"type": "object", "required": ["data"], "properties": {
            "data": {"type": "string"}, "id": {"type": "string"},
            "event": {"type": "string"}}},
        "Usage": _usage(),
        "ChatCompletion": _completion("chat.completion", _choice({"message": message_out})),
        "Completion": _completion("text_completion", _choice({"text": {"type": "string"}})),
        "Model": model,
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"enum": ["list"]}, "data": {"type": "array", "items": _ref("Model")}}},
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": _nullable({"type": "string"}),
                           "code": _nullable({"type": "string"})}}}},
    }


def _embedding_schemas() -> dict[str, Any]:
    ids = {"type": "array", "minItems": 1,
           "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}}
    text = {"type": "string", "minLength": 1}
    return {
        "EmbeddingRequest": {
            "type": "object", "required": ["model", "input"], "additionalProperties": False,
            "properties": {
                "model": {"type": "string", "minLength": 1, "maxLength": 256},
                "input": {"oneOf": [text, ids, {"type": "array", "minItems": 1,
                                                "maxItems": emb.MAX_INPUTS,
                                                "items": {"oneOf": [text, ids]}}]},
                "encoding_format": _nullable({"type": "string", "enum": ["float", "base64"]}),
                "dimensions": _nullable({"type": "integer", "minimum": 1, "maximum": 65536}),
                "user": _nullable({"type": "string", "maxLength": 256})}},
        "EmbeddingList": {"type": "object", "required": ["object", "data", "model", "usage"],
                          "properties": {
                              "object": {"enum": ["list"]}, "model": {"type": "string"},
                              "data": {"type": "array", "items": {
                                  "type": "object", "required": ["index", "embedding"],
                                  "properties": {"object": {"enum": ["embedding"]},
                                                 "index": {"type": "integer"},
                                                 "embedding": {"oneOf": [
                                                     {"type": "array",
                                                      "items": {"type": "number"}},
                                                     {"type": "string"}]}}}},
                              "usage": {"type": "object"}}},
    }


def _responses_schemas() -> dict[str, Any]:
    props: dict[str, Any] = {name: {"nullable": True, "description": "Accepted and ignored."}
                             for name in sorted(rapi.IGNORED)}
    props.update({
        "model": {"type": "string", "minLength": 1, "maxLength": 256},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                                 "items": {"type": "object"}}],
                  "description": "Messages, function_call and function_call_output items."},
        "instructions": _nullable({"type": "string"}),
        "tools": _nullable({"type": "array", "items": {"type": "object"}}),
        "tool_choice": {"nullable": True},
        "parallel_tool_calls": _nullable({"type": "boolean"}),
        "max_output_tokens": _nullable({"type": "integer", "minimum": 1,
                                        "maximum": MAX_TOKENS_CEILING}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}),
        "stream": _nullable({"type": "boolean"}),
        "text": _nullable({"type": "object"}),
        "user": _nullable({"type": "string", "maxLength": 256}),
        "safety_identifier": _nullable({"type": "string", "maxLength": 256}),
        "prompt_cache_key": _nullable({"type": "string", "maxLength": 256}),
        "previous_response_id": _nullable({"type": "string", "description":
                                           "Refused (400): no responses are stored."}),
    })
    assert set(props) == set(rapi.FIELDS), set(props) ^ set(rapi.FIELDS)
    return {
        "ResponseRequest": {"type": "object", "required": ["model", "input"],
                            "additionalProperties": False, "properties": props},
        "Response": {"type": "object", "required": ["id", "object", "status", "output"],
                     "properties": {"id": {"type": "string"}, "object": {"enum": ["response"]},
                                    "status": {"type": "string"},
                                    "output": {"type": "array", "items": {"type": "object"}},
                                    "usage": {"nullable": True, "type": "object"}}},
    }


def _errors(statuses: dict[str, str]) -> dict[str, Any]:
    body = {"application/json": {"schema": _ref("Error")}}
    return {code: {"description": why, "content": body} for code, why in statuses.items()}


def _post(summary: str, request: str, response: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "security": [{"apiKey": []}],
        "parameters": [
            {"name": "Idempotency-Key", "in": "header", "required": False,
             "schema": {"type": "string", "maxLength": 256},
             "description": "Replays a finished non-streaming answer instead of running again."},
            {"name": "Last-Event-ID", "in": "header", "required": False,
             "schema": {"type": "string", "maxLength": 256},
             "description": "With stream: true, resume this tenant's stream after that event."},
        ],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "The completion (JSON), or its event stream when stream: true",
                    "content": {"application/json": {"schema": _ref(response)},
                                "text/event-stream": {"schema": _ref("StreamEvent")}}},
            **_errors(POST_ERRORS),
        },
    }}


def _get(summary: str, response: str,
         params: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary, "security": [{"apiKey": []}],
        "responses": {"200": {"description": "OK", "content": {
            "application/json": {"schema": _ref(response)}}}, **_errors(GET_ERRORS)},
    }
    if params:
        op["parameters"] = params
    return {"get": op}


@cache
def spec() -> dict[str, Any]:
    model_param = [{"name": "model", "in": "path", "required": True,
                    "schema": {"type": "string", "pattern": "^[^/]+$"}}]
    return {
        "openapi": "3.0.3",
        "info": {"title": "Inference gateway: OpenAI-compatible API", "version": "1"},
        "servers": [{"url": "/"}],
        "paths": {
            "/v1/chat/completions": _post("Create a chat completion", "ChatCompletionRequest",
                                          "ChatCompletion"),
            "/v1/completions": _post("Create a completion", "CompletionRequest", "Completion"),
            "/v1/responses": _post("Create a response (stateless)", "ResponseRequest",
                                   "Response"),
            "/v1/embeddings": _post("Create embeddings", "EmbeddingRequest", "EmbeddingList"),
            "/v1/models": _get("Models this key may use", "ModelList"),
            "/v1/models/{model}": _get("One model this key may use", "Model", model_param),
        },
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
    }


@cache
def spec_bytes() -> bytes:
    return json.dumps(spec(), separators=(",", ":")).encode()


def consumer() -> Any:
    """``GET /v1/openapi.json`` (no credential: the document is the same for everyone)."""
    class OpenApiConsumer(ApiConsumer):
        methods = ("GET",)

        async def handle(self, body: bytes) -> None:
            await self.send_json(200, spec_bytes())

    return OpenApiConsumer
