"""Bounds on a client's JSON schema, checked before anything walks or samples it.

A schema is the client's program for the constrained decoder: a 2.6 KB ``$defs`` chain whose
levels each ``$ref`` the next twice describes a 2^20-node document, and anything that expands
it (a checker that walks every path, a sampler, a grammar compiler) does 2^20 work. So every
schema, on every backend, is measured first, in time linear in its text:

- ``MAX_SCHEMA_BYTES``: its compact JSON text;
- ``MAX_SCHEMA_DEPTH``: nesting of JSON objects and arrays in the text;
- ``MAX_SCHEMA_NODES``: objects and arrays in the text;
- ``MAX_SCHEMA_EXPANDED``: objects and arrays once every ``$ref`` is replaced by its target,
  computed with one memo entry per object (a shared subschema is counted, not walked, again),
  so the 20-level chain is refused after 20 steps, not 2^20. A reference back into a schema
  that is still being measured (recursion) counts one node: recursion is bounded by the
  sampler's depth limit and its work budget, not here.

The figures leave room for what OpenAI's strict mode accepts (5,000 properties, 10 levels).
"""

from __future__ import annotations

import json
from typing import Any

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_NODES = 10_000
MAX_SCHEMA_EXPANDED = 20_000
_NOT_INSTANTIATED = ("$defs", "definitions")


class SchemaError(ValueError):
    """The schema uses something the sampler cannot satisfy, or is not a schema."""


class SchemaTooLarge(SchemaError):
    """The schema exceeds one of the bounds; the message names which."""


def check_bounds(schema: Any, text: str | None = None) -> None:
    """Raise SchemaTooLarge unless ``schema`` is within every bound (``text``: its JSON, when
    the caller already has it)."""
    size = len(text.encode()) if text is not None else _byte_size(schema)
    if size > MAX_SCHEMA_BYTES:
        raise SchemaTooLarge(f"the schema is {size} bytes (at most {MAX_SCHEMA_BYTES})")
    _check_shape(schema)
    try:
        expanded = _Expansion(schema).size(schema)
    except RecursionError:  # a $ref chain longer than the stack: far past any bound
        raise SchemaTooLarge("the schema's $refs chain too deeply") from None
    if expanded > MAX_SCHEMA_EXPANDED:
        raise SchemaTooLarge(f"the schema expands to more than {MAX_SCHEMA_EXPANDED} "
                             "subschemas once its $refs are followed")


def _byte_size(schema: Any) -> int:
    try:
        return len(json.dumps(schema, separators=(",", ":")).encode())
    except (TypeError, ValueError, RecursionError):
        raise SchemaTooLarge("the schema is not JSON or is nested too deeply") from None


def _check_shape(schema: Any) -> None:
    """Depth and node count, iteratively (a deep schema must not exhaust the stack)."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaTooLarge(f"the schema nests more than {MAX_SCHEMA_DEPTH} levels")
        if nodes > MAX_SCHEMA_NODES:
            raise SchemaTooLarge(f"the schema has more than {MAX_SCHEMA_NODES} objects and "
                                 "arrays")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children)


class _Expansion:
    """Expanded node counts, memoised per object; saturates just above the bound."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.memo: dict[int, int] = {}
        self.active: set[int] = set()

    def size(self, node: Any) -> int:
        if not isinstance(node, (dict, list)):
            return 0
        key = id(node)
        if key in self.memo:
            return self.memo[key]
        if key in self.active:  # recursion: bounded later by depth and budget
            return 1
        self.active.add(key)
        total = 1
        if isinstance(node, dict):
            children = [v for k, v in node.items() if k not in _NOT_INSTANTIATED]
            ref = node.get("$ref")
            if isinstance(ref, str):
                children.append(_target(self.root, ref))
        else:
            children = list(node)
        for child in children:
            total = min(total + self.size(child), MAX_SCHEMA_EXPANDED + 1)
        self.active.discard(key)
        self.memo[key] = total
        return total


def _target(root: Any, ref: str) -> Any:
    """The local target of ``ref``, or None (an unresolvable one is refused elsewhere)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].strip("/").split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
