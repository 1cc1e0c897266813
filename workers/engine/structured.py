"""The JSON schema vLLM is given for structured outputs, made safe for its grammar compilers.

A JSON string may not hold a raw control character (U+0000-U+001F, RFC 8259 section 7), and
``json.loads`` refuses one. vLLM's default backend, xgrammar (0.2.8 in vLLM 0.32/0.33), compiles
a string schema with ``minLength`` or ``maxLength`` to a bounded repetition of ``[^"\\\\\\r\\n]``:
a class that admits every other control character (a raw TAB, U+0001, ...) and no escape at
all (xgrammar issue 800, open upstream). So a model that samples a TAB inside such a string
(the tests' random-weight model did) produces an answer that is not JSON. An unbounded string
and vLLM's ``json_object`` use xgrammar's general string rule, which excludes them.

``for_vllm`` rewrites each length-bounded string subschema (one without ``pattern``, ``format``,
``enum`` or ``const``) into one the engines compile to valid JSON, with the same meaning:

- bounds up to ``PATTERN_MAX_LENGTH``: ``minLength``/``maxLength`` become
  ``pattern: ^[\\s\\S]{m,n}$`` (JSON Schema counts code points, and so does the regex). xgrammar
  compiles a pattern with its JSON-string regex, whose characters exclude raw control
  characters (and, as the bounded rule did already, escapes). Its cost grows with the square
  of the bound (about 0.08 s at 256 on the tests' 2 k vocabulary, 40 s at 9,000), hence the cap;
- longer bounds keep ``minLength``/``maxLength`` and gain the neutral ``pattern: ^[\\s\\S]*$``.
  xgrammar does not take a pattern with length bounds (vLLM's tracking of xgrammar issue 966),
  so vLLM's ``auto`` backend compiles the request with llguidance, whose JSON strings are exact
  (escapes allowed, control characters refused, any bound at constant cost). An engine pinned
  to ``xgrammar`` refuses such a request up front rather than produce invalid JSON.

Only schema positions are rewritten (``properties``, ``items``, ``anyOf``, ``$defs``, ...), never
data inside ``const``, ``enum``, ``default`` or ``examples``. The input is not modified.
"""

from __future__ import annotations

import copy
from typing import Any

PATTERN_MAX_LENGTH = 256
ANY_STRING = r"^[\s\S]*$"

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems",
        "unevaluatedProperties", "propertyNames", "contains", "not", "if", "then", "else")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def for_vllm(schema: Any) -> Any:
    """A copy of ``schema`` whose length-bounded strings compile to valid JSON (see above)."""
    out = copy.deepcopy(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        _rewrite_string(node)
        for key in _ONE:
            if isinstance(node.get(key), dict):
                stack.append(node[key])
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _MAP:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
    return out


def _bound(node: dict[str, Any], key: str) -> int | None:
    value = node.get(key)
    return value if type(value) is int and value >= 0 else None


def _rewrite_string(node: dict[str, Any]) -> None:
    kind = node.get("type")
    types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if "string" not in types or any(k in node for k in ("pattern", "format", "enum", "const")):
        return
    low, high = _bound(node, "minLength"), _bound(node, "maxLength")
    if (low is None and high is None) or (low is not None and high is not None and low > high):
        return  # nothing to rewrite, or no string fits (the gateway refuses that schema)
    if max(low or 0, high or 0) > PATTERN_MAX_LENGTH:
        node["pattern"] = ANY_STRING
        return
    node.pop("minLength", None)
    node.pop("maxLength", None)
    node["pattern"] = f"^[\\s\\S]{{{low or 0},{'' if high is None else high}}}$"
