"""Schema-valid JSON for the simulated engine's constrained decoding.

A real engine masks the logits so every sampled token keeps the output inside the grammar of a
JSON schema (vLLM's structured outputs, xgrammar). The simulated engine has no logits over JSON,
so it draws a whole document that satisfies the schema, from the request's own random stream,
and then emits that document's tokens one step at a time: what a client sees (valid JSON, cut
short only by ``max_tokens``, deterministic for a seed) is what constrained decoding gives.

Supported keywords are the subset OpenAI's strict mode accepts plus common extras: ``type``
(one or a list), ``properties``/``required``/``additionalProperties``, ``items``/``prefixItems``,
``minItems``/``maxItems``, ``enum``, ``const``, ``anyOf``/``oneOf``/``allOf`` (first member),
``$ref`` to ``#/$defs/...`` or ``#/definitions/...``, ``minimum``/``maximum`` and
``exclusiveMinimum``/``exclusiveMaximum``, ``minLength``/``maxLength``, and the ``format``s
date, date-time, time, email, uri and uuid. ``pattern`` cannot be honoured by sampling words,
so ``SchemaError`` refuses it up front (the gateway answers 400 naming it).
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable
from typing import Any

MAX_DEPTH = 12  # nesting beyond this (recursive $refs) ends in the shortest valid value
OPTIONAL_PROPERTY_CHANCE = 0.5
_UNSUPPORTED = ("pattern", "patternProperties", "not", "if", "dependentSchemas")


class SchemaError(ValueError):
    """The schema uses something the sampler cannot satisfy, or is not a schema."""


def check_schema(schema: Any) -> None:
    """Raise SchemaError when ``sample_json`` could not honour the schema."""
    _walk(schema, schema, 0, set())


def _walk(node: Any, root: Any, depth: int, seen: set[str]) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise SchemaError("a schema must be an object")
    for word in _UNSUPPORTED:
        if word in node:
            raise SchemaError(f"the JSON schema keyword '{word}' is not supported")
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref not in seen:
            _walk(_resolve(root, ref), root, depth, seen | {ref})
        return
    for key in ("properties", "$defs", "definitions"):
        for child in (node.get(key) or {}).values():
            _walk(child, root, depth + 1, seen)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for child in node.get(key) or ():
            _walk(child, root, depth + 1, seen)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _walk(node[key], root, depth + 1, seen)


def _resolve(root: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        raise SchemaError(f"only local $ref is supported, not {ref!r}")
    node = root
    for part in ref.lstrip("#").strip("/").split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise SchemaError(f"$ref {ref!r} does not resolve")
        node = node[part]
    return node


class JsonSampler:
    """Draws one JSON value for a schema; ``words`` supplies string content."""

    def __init__(self, rng: random.Random, words: list[str], root: Any) -> None:
        self.rng = rng
        self.words = words or ["value"]
        self.root = root

    def value(self, schema: Any, depth: int = 0) -> Any:
        if schema is True or schema == {} or schema is None:
            return self._any(depth)
        if schema is False:
            raise SchemaError("a false schema admits no value")
        if "$ref" in schema:
            return self.value(_resolve(self.root, schema["$ref"]), depth + 1)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return self.rng.choice(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if schema.get(key):
                options = schema[key]
                # Deep down, the first option (usually the simplest) ends recursion.
                chosen = options[0] if depth >= MAX_DEPTH else self.rng.choice(options)
                return self.value({**_without(schema, key), **chosen}, depth + 1)
        if schema.get("allOf"):
            merged = dict(_without(schema, "allOf"))
            for part in schema["allOf"]:
                merged.update(part)
            return self.value(merged, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kinds = [k for k in kind if k != "null"] or ["null"]
            kind = kinds[0] if depth >= MAX_DEPTH else self.rng.choice(kinds)
        if kind is None:
            kind = _implied_type(schema)
        make: Callable[[dict[str, Any], int], Any] | None = getattr(self, f"_{kind}", None)
        if make is None:
            raise SchemaError(f"unknown JSON schema type {kind!r}")
        return make(schema, depth)

    def _any(self, depth: int) -> Any:
        return self._string({}, depth) if depth else {"answer": self._string({}, depth)}

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        props: dict[str, Any] = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        out: dict[str, Any] = {}
        for name, sub in props.items():
            optional_kept = depth < MAX_DEPTH and self.rng.random() < OPTIONAL_PROPERTY_CHANCE
            if name in required or optional_kept:
                out[name] = self.value(sub, depth + 1)
        if not props and schema.get("additionalProperties") not in (False, None) and depth < 2:
            extra = schema["additionalProperties"]
            out[self.rng.choice(self.words)] = self.value(
                extra if isinstance(extra, dict) else {}, depth + 1)
        return out

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        prefix = list(schema.get("prefixItems") or ())
        low = int(schema.get("minItems", 0))
        high = int(schema.get("maxItems", max(low, 3)))
        if high < low:
            raise SchemaError("the schema's minItems is above its maxItems")
        count = low if depth >= MAX_DEPTH else self.rng.randint(max(low, min(1, high)),
                                                                 min(high, low + 3))
        count = max(count, min(len(prefix), high))
        items = schema.get("items", {})
        return [self.value(prefix[i] if i < len(prefix) else items, depth + 1)
                for i in range(count)]

    def _string(self, schema: dict[str, Any], depth: int) -> str:
        fmt = schema.get("format")
        if fmt in _FORMATS:
            return _FORMATS[fmt](self.rng)
        low = int(schema.get("minLength", 0))
        high = int(schema.get("maxLength", 60))
        words = [self.rng.choice(self.words) for _ in range(self.rng.randint(1, 4))]
        text = " ".join(words)[:high]
        while len(text) < low:
            text += " " + self.rng.choice(self.words)
        return text[:high] if high >= low else text

    def _integer(self, schema: dict[str, Any], depth: int) -> int:
        low, high = _bounds(schema, integer=True)
        return self.rng.randint(int(low), int(high))

    def _number(self, schema: dict[str, Any], depth: int) -> float:
        low, high = _bounds(schema, integer=False)
        return round(self.rng.uniform(low, high), 3) if high > low else float(low)

    def _boolean(self, schema: dict[str, Any], depth: int) -> bool:
        return self.rng.random() < 0.5

    def _null(self, schema: dict[str, Any], depth: int) -> None:
        return None


def _without(schema: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k != key}


def _implied_type(schema: dict[str, Any]) -> str:
    if "properties" in schema or "additionalProperties" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return "string"


def _bounds(schema: dict[str, Any], *, integer: bool) -> tuple[float, float]:
    step = 1 if integer else 0.001
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    if "exclusiveMinimum" in schema and "minimum" not in schema:
        low = schema["exclusiveMinimum"] + step
    high = schema.get("maximum")
    if "exclusiveMaximum" in schema and "maximum" not in schema:
        high = schema["exclusiveMaximum"] - step
    low = 0 if low is None else low
    high = (low + 100) if high is None else high
    if integer:
        import math

        low, high = math.ceil(low), math.floor(high)
    if high < low:
        raise SchemaError("the schema's minimum is above its maximum")
    return low, high


_FORMATS: dict[str, Callable[[random.Random], str]] = {
    "date": lambda r: f"20{r.randint(10, 29)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "date-time": lambda r: (f"20{r.randint(10, 29)}-{r.randint(1, 12):02d}-"
                            f"{r.randint(1, 28):02d}T{r.randint(0, 23):02d}:"
                            f"{r.randint(0, 59):02d}:00Z"),
    "time": lambda r: f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:00",
    "email": lambda r: f"user{r.randint(1, 999)}@example.com",
    "uri": lambda r: f"https://example.com/{r.randint(1, 999)}",
    "uuid": lambda r: str(uuid.UUID(int=r.getrandbits(128), version=4)),
}


def sample_json(schema: Any, rng: random.Random, words: list[str]) -> str:
    """One schema-valid JSON document as compact text (``None`` schema: any JSON object)."""
    if schema is None:
        schema = {"type": "object"}
    sampler = JsonSampler(rng, words, schema)
    value = sampler.value(schema)
    if schema == {"type": "object"} and not value:
        value = {"answer": sampler.value({"type": "string"}, 1)}
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
