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

from serving.schema_depth import Depths, implied_type, least_ranked, resolve
from serving.schema_limits import SchemaError as SchemaError
from serving.schema_limits import check_bounds

MAX_DEPTH = 12  # nesting beyond this (recursive $refs) ends in the shortest valid value
HARD_DEPTH = 100  # below MAX_DEPTH, steps on the way to the shortest value (schema_depth)
OPTIONAL_PROPERTY_CHANCE = 0.5
_UNSUPPORTED = ("pattern", "patternProperties", "not", "if", "dependentSchemas")


def check_schema(schema: Any, *, engine: bool = True) -> None:
    """Raise SchemaError when the schema is out of bounds (``schema_limits``), has a keyword
    value no validator could honour (``minimum: "a"``, ``minItems`` above ``maxItems``), or,
    with ``engine``, uses a keyword ``sample_json`` cannot honour. Linear in the schema's size:
    each object is checked once however many paths or $refs reach it."""
    check_bounds(schema)
    _Walk(schema, engine).run()
    if Depths(schema).rank(schema) is None:
        raise SchemaError("the schema admits no finite value: it requires itself without end "
                          "(a $ref that leads back to itself, or a required property or "
                          "minItems that does)")


_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})


class _Walk:
    def __init__(self, root: Any, engine: bool) -> None:
        self.root = root
        self.engine = engine
        self.done: set[int] = set()  # objects already checked, by identity (memo and cycles)

    def run(self) -> None:
        stack: list[Any] = [self.root]
        while stack:
            node = stack.pop()
            if isinstance(node, bool) or id(node) in self.done:
                continue
            if not isinstance(node, dict):
                raise SchemaError("a schema must be an object")
            self.done.add(id(node))
            self.check_node(node)
            stack.extend(self.children(node))

    def check_node(self, node: dict[str, Any]) -> None:
        if self.engine:
            for word in _UNSUPPORTED:
                if word in node:
                    raise SchemaError(f"the JSON schema keyword '{word}' is not supported")
        for word in _COUNTS:
            value = node.get(word)
            if word in node and (type(value) is not int or value < 0):
                raise SchemaError(f"'{word}' must be a non-negative integer")
        for word in _NUMBERS:
            value = node.get(word)
            if word in node and (type(value) not in (int, float) or value != value
                                 or value in (float("inf"), float("-inf"))):
                raise SchemaError(f"'{word}' must be a number")
        for low, high in (("minItems", "maxItems"), ("minLength", "maxLength"),
                          ("minProperties", "maxProperties"), ("minimum", "maximum")):
            if low in node and high in node and node[low] > node[high]:
                raise SchemaError(f"the schema's {low} is above its {high}")
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
        if not all(isinstance(k, str) and k in _TYPES for k in kinds):
            raise SchemaError(f"unknown JSON schema type {kind!r}")
        if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
            raise SchemaError("'enum' must be a non-empty array")
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError("'required' must be an array of property names")

    def children(self, node: dict[str, Any]) -> list[Any]:
        out: list[Any] = []
        ref = node.get("$ref")
        if isinstance(ref, str):
            out.append(resolve(self.root, ref))
        for key in ("properties", "$defs", "definitions"):
            group = node.get(key)
            if group is not None and not isinstance(group, dict):
                raise SchemaError(f"'{key}' must be an object")
            out.extend((group or {}).values())
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            group = node.get(key)
            if group is not None and not isinstance(group, list):
                raise SchemaError(f"'{key}' must be an array")
            out.extend(group or ())
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                out.append(node[key])
        return out


class JsonSampler:
    """Draws one JSON value for a schema; ``words`` supplies string content.

    ``budget`` bounds the work (about one unit per character of output and per value): past
    it, arrays and objects stop growing and strings stop lengthening, and ``exhausted`` is
    set. The caller asks for a budget that covers the tokens it will emit (``max_tokens``), so
    a ``minItems: 600000`` costs what the client pays for, and the prefix it sees is the prefix
    of the document the schema describes (the same random draws, in the same order).
    """

    def __init__(self, rng: random.Random, words: list[str], root: Any,
                 budget: int | None = None) -> None:
        self.rng = rng
        self.words = words or ["value"]
        self.root = root
        self.budget = budget
        self.spent = 0
        self.exhausted = False
        self.depths = Depths(root)

    def _spend(self, units: int) -> bool:
        """Count ``units`` of work; False once the budget is spent."""
        self.spent += units
        if self.budget is not None and self.spent > self.budget:
            self.exhausted = True
        return not self.exhausted

    def value(self, schema: Any, depth: int = 0) -> Any:
        self._spend(2)
        if schema is True or schema == {} or schema is None:
            return self._any(depth)
        if schema is False:
            raise SchemaError("a false schema admits no value")
        if depth > MAX_DEPTH + HARD_DEPTH:  # only a schema check_schema refuses gets here
            raise SchemaError("the schema nests without end")
        if "$ref" in schema:
            return self.value(resolve(self.root, schema["$ref"]), depth + 1)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return self.rng.choice(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if schema.get(key):
                # Only options with a value; deep down, the shortest, which ends recursion.
                options = least_ranked(schema[key], self.depths.rank)
                if not options:
                    raise SchemaError(f"no '{key}' option of the schema admits a finite value")
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
            if depth >= MAX_DEPTH:  # the kind whose shortest value is shortest
                kinds = least_ranked(kinds, lambda k: self.depths.rank({**schema, "type": k}))
            kind = kinds[0] if depth >= MAX_DEPTH else self.rng.choice(kinds)
        if kind is None:
            kind = implied_type(schema)
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
            if not self._spend(len(name) + 4):
                break
            optional_kept = (depth < MAX_DEPTH and self.rng.random() < OPTIONAL_PROPERTY_CHANCE
                             and self.depths.rank(sub) is not None)
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
        if self.depths.rank(items) is None:  # items without a value: only what is required
            count = min(count, max(low, min(len(prefix), high)))
        out: list[Any] = []
        for i in range(count):
            if not self._spend(2):
                break
            out.append(self.value(prefix[i] if i < len(prefix) else items, depth + 1))
        return out

    def _string(self, schema: dict[str, Any], depth: int) -> str:
        fmt = schema.get("format")
        if fmt in _FORMATS:
            return _FORMATS[fmt](self.rng)
        low = int(schema.get("minLength", 0))
        high = int(schema.get("maxLength", 60))
        words = [self.rng.choice(self.words) for _ in range(self.rng.randint(1, 4))]
        text = " ".join(words)[:high]
        parts, length = [text], len(text)
        while length < low and self._spend(len(parts[-1]) + 1):
            parts.append(self.rng.choice(self.words))
            length += 1 + len(parts[-1])
        self._spend(len(parts[0]))
        text = " ".join(parts)
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


DEFAULT_BUDGET = 65_536  # work units when the caller names none (a tool call's arguments)


def sample_json(schema: Any, rng: random.Random, words: list[str],
                budget: int = DEFAULT_BUDGET) -> str:
    """One schema-valid JSON document as compact text (``None`` schema: any JSON object); past
    ``budget`` (see ``JsonSampler``) a prefix-faithful but shortened one."""
    return sample_json_bounded(schema, rng, words, budget)[0]


def sample_json_bounded(schema: Any, rng: random.Random, words: list[str],
                        budget: int) -> tuple[str, bool]:
    """``sample_json`` and whether the budget cut the document short."""
    if schema is None:
        schema = {"type": "object"}
    sampler = JsonSampler(rng, words, schema, budget)
    value = sampler.value(schema)
    if schema == {"type": "object"} and not value:
        value = {"answer": sampler.value({"type": "string"}, 1)}
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": ")), sampler.exhausted
