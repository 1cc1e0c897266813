"""Schemas that require themselves without end (serving/schema_depth.py): the gateway refuses
them with a 400, and a schema that recurses but has a finite value is sampled to an end."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from serving.guided import SchemaError, check_schema, sample_json
from serving.schema_depth import Depths, least_ranked

NODE: dict[str, Any] = {"type": "object", "properties": {"value": {"type": "integer"}}}
ENDLESS = [
    {"$ref": "#"},
    {"$defs": {"b": {"$ref": "#/$defs/b"}}, "type": "object",
     "properties": {"c": {"anyOf": [{"$ref": "#/$defs/b"}]}}, "required": ["c"]},
    {"$defs": {"x": {"anyOf": [{"$ref": "#/$defs/x"}]}}, "$ref": "#/$defs/x"},
    # A required child of its own kind: every value would be infinite.
    {**NODE, "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    # At least one item, each requiring the list again (what the fuzz found, made small).
    {"$defs": {"l": {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/l"}}}}},
     "$ref": "#/$defs/l"},
]
FINITE = [
    # Optional recursion, an Optional[...] as pydantic writes it, an empty list allowed.
    {**NODE, "properties": {"next": {"$ref": "#"}}},
    {**NODE, "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
     "required": ["next"]},
    {**NODE, "properties": {"children": {"type": "array", "items": {"$ref": "#"}}},
     "required": ["children"]},
    {"$defs": {"t": {"type": ["object", "string"], "required": ["t"],
                     "properties": {"t": {"$ref": "#/$defs/t"}}}}, "$ref": "#/$defs/t"},
]


@pytest.mark.parametrize("schema", ENDLESS)
def test_a_schema_that_requires_itself_without_end_is_refused(schema: dict[str, Any]) -> None:
    assert Depths(schema).rank(schema) is None
    with pytest.raises(SchemaError, match="no finite value"):
        check_schema(schema)


@pytest.mark.parametrize("schema", FINITE)
def test_a_recursive_schema_with_a_finite_value_is_sampled_to_an_end(
        schema: dict[str, Any]) -> None:
    check_schema(schema)
    for seed in range(30):
        document = json.loads(sample_json(schema, random.Random(seed), ["w"]))
        assert document is not None


def test_the_shortest_alternative_is_ranked_first() -> None:
    leaf: dict[str, Any] = {"type": "null"}
    deep: dict[str, Any] = {"type": "object", "required": ["a"], "properties": {"a": leaf}}
    schema = {"anyOf": [deep, leaf]}
    depths = Depths(schema)
    assert (depths.rank(leaf), depths.rank(deep), depths.rank(schema)) == (0, 1, 1)
    assert least_ranked([deep, leaf], depths.rank) == [leaf, deep]


def test_the_fuzz_finding_is_a_400_at_the_gateway() -> None:
    """tests/test_schema_bounds.py's fuzz found this one (a RecursionError in the sampler)."""
    from gateway.inference.errors import ApiError
    from tests.test_schema_bounds import as_response_format, gateway_check

    found = {"anyOf": [{"type": "object", "properties": {
        "c": {"anyOf": [{"$ref": "#/$defs/b"}]},
        "a": {"anyOf": [{"$ref": "#/$defs/l1"}]}}, "required": ["a", "c"]}],
        "$defs": {"b": {"$ref": "#/$defs/b"}, "l1": {
            "type": "object", "required": ["a", "b"],
            "properties": {"b": {"$ref": "#/$defs/b"}, "a": {"$ref": "#/$defs/a"}}},
            "a": {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/l1"},
                             "minItems": 14}]}}}
    error = gateway_check(as_response_format(found))
    assert isinstance(error, ApiError) and error.status == 400
    assert error.param == "response_format" and "no finite value" in error.message
