"""Which parts of a JSON schema have a finite value, and how short the shortest one is.

A schema can require itself without end: ``{"$defs": {"b": {"$ref": "#/$defs/b"}}}``, or an
object whose required property is an array of at least one such object. No document satisfies
it, and a sampler that follows it recurses until the interpreter gives up (the fuzz of
tests/test_schema_bounds.py found one). ``Depths`` answers, for every sub-schema, the depth of its
shortest value, or leaves it out when it has none: the fixpoint by which a grammar's productive
symbols are found. The gateway refuses a schema whose root has none (400), and the sampler picks,
deep down, the alternative of least rank, so it always ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from serving.schema_limits import SchemaError


class Depths:
    """Every sub-schema reachable from ``root`` that has a finite value, with its rank."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.nodes = {id(n): n for n in _reachable(root)}
        self.known: dict[int, int] = {}  # id(sub-schema) -> the depth of its shortest value
        grew = True
        while grew:  # at most one round per level of the deepest shortest value
            grew = False
            for key, node in self.nodes.items():
                if key not in self.known and (r := self._one_level(node)) is not None:
                    self.known[key] = r
                    grew = True

    def rank(self, node: Any) -> int | None:
        """The depth of the shortest value of ``node``; None when it has none. A dict that is
        not one of the schema's own nodes (the sampler's merge of an ``anyOf`` choice into its
        parent) is ranked from its parts."""
        if isinstance(node, dict) and id(node) in self.nodes:
            return self.known.get(id(node))
        return self._one_level(node)

    def _one_level(self, node: Any) -> int | None:
        if node is True or node is None or node == {}:
            return 0
        if node is False:
            return None  # a false schema has no value
        if not isinstance(node, dict):
            raise SchemaError("a schema must be an object or a boolean")
        return _rank(node, self.root, self.rank)


def _rank(node: dict[str, Any], root: Any, child: Callable[[Any], int | None]) -> int | None:
    if isinstance(node.get("$ref"), str):
        return _plus(child(resolve(root, node["$ref"])))
    if "const" in node or "enum" in node:
        return 0
    for key in ("anyOf", "oneOf"):
        if node.get(key):
            best = _least(child(o) for o in node[key])
            return _plus(_most([best, child({k: v for k, v in node.items() if k != key})]))
    if node.get("allOf"):
        rest = {k: v for k, v in node.items() if k != "allOf"}
        return _plus(_most([*(child(p) for p in node["allOf"]), child(rest)]))
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind or implied_type(node)]
    return _least(_kind_rank(node, k, child) for k in kinds)


def _kind_rank(node: dict[str, Any], kind: str, child: Callable[[Any], int | None]) -> int | None:
    if kind == "object":
        props = node.get("properties") or {}
        needed = [props[name] for name in node.get("required") or () if name in props]
        return _plus(_most(child(p) for p in needed))
    if kind == "array":
        prefix = list(node.get("prefixItems") or ())
        low, high = int(node.get("minItems", 0)), int(node.get("maxItems", 1 << 30))
        needed = prefix[:high] + ([node.get("items", {})] if low > len(prefix) else [])
        return _plus(_most(child(p) for p in needed))
    return 0


def least_ranked(options: list[Any], rank: Callable[[Any], int | None]) -> list[Any]:
    """The options that have a value, least rank first (stable: the schema's order breaks ties)."""
    ranked = [(r, i) for i, o in enumerate(options) if (r := rank(o)) is not None]
    return [options[i] for _, i in sorted(ranked)]


def implied_type(schema: dict[str, Any]) -> str:
    if "properties" in schema or "additionalProperties" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return "string"


def resolve(root: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        raise SchemaError(f"only local $ref is supported, not {ref!r}")
    node = root
    for part in ref.lstrip("#").strip("/").split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise SchemaError(f"$ref {ref!r} does not resolve")
        node = node[part]
    return node


def _reachable(root: Any) -> Iterator[dict[str, Any]]:
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        if isinstance(node.get("$ref"), str):
            stack.append(resolve(root, node["$ref"]))
        for key in ("properties", "$defs", "definitions"):
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in ("items", "additionalProperties"):
            stack.append(node.get(key))


def _plus(r: int | None) -> int | None:
    return None if r is None else r + 1


def _least(rs: Any) -> int | None:
    found = [r for r in rs if r is not None]
    return min(found) if found else None


def _most(rs: Any) -> int | None:
    """The max of the ranks, 0 for none; None when any is None (that part has no value)."""
    out = 0
    for r in rs:
        if r is None:
            return None
        out = max(out, r)
    return out
