"""A JSON Schema subset -> the grammar nodes of automaton.py.

Supported: `type` (string, number, integer, boolean, null, object, array, or a list of them), `properties` with
`required` (an object's keys come out in the order `properties` lists them; no other keys: `additionalProperties`
may only be absent or false), `items` with `minItems`/`maxItems`, `enum`, `const`, `anyOf`, nesting of all of
these, and the empty schema / `true` (any JSON value). `{"type": "object"}` without `properties` is any object.
Annotations (`title`, `description`, `default`, `examples`, `$schema`, `$id`, `$comment`) are ignored.

Refused with a ValueError naming the keyword: everything else, in particular `$ref`/`$defs` (recursive schemas),
`oneOf`/`allOf`/`not`/`if` (need intersection or exclusion, not just choice), `patternProperties`,
`additionalProperties` other than false, `pattern`/`format`/`minLength`/`maxLength` (a regular language on the
characters of a string), `minimum`/`maximum`/`multipleOf` (constraints on a number's value), `uniqueItems`,
`prefixItems`, and `false`.
"""
from __future__ import annotations

import json

from .automaton import ITEM_SEP, KEY_SEP, AnyObject, AnyOf, Array, Literal, Node, Number, Object, Property, String, \
    any_value

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment"})
SUPPORTED = frozenset({"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                       "enum", "const", "anyOf"})
TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")


class SchemaError(ValueError):
    """The schema uses something this grammar compiler does not support, or is not a valid schema."""


def dumps(value) -> str:
    """A JSON value in the layout the grammar produces (no whitespace but one space after ',' and ':')."""
    return json.dumps(value, ensure_ascii=False, separators=(ITEM_SEP.decode(), KEY_SEP.decode()))


def compile_schema(schema, path: str = "$") -> Node:
    """The grammar node for `schema` (a dict, or True for any value). `path` names the place in error messages."""
    if schema is True or schema == {}:
        return any_value()
    if not isinstance(schema, dict):
        raise SchemaError(f"{path}: a schema must be an object (or true), got {schema!r}")
    unknown = sorted(set(schema) - SUPPORTED - ANNOTATIONS)
    if unknown:
        raise SchemaError(f"{path}: unsupported JSON Schema keyword(s) {', '.join(map(repr, unknown))}; supported: "
                          f"{', '.join(sorted(SUPPORTED))} (and annotations such as title, description)")
    if "const" in schema:
        return Literal((dumps(schema["const"]).encode(),))
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"{path}.enum: must be a non-empty list, got {values!r}")
        return Literal(tuple(dict.fromkeys(dumps(v).encode() for v in values)))
    if "anyOf" in schema:
        options = schema["anyOf"]
        if not isinstance(options, list) or not options:
            raise SchemaError(f"{path}.anyOf: must be a non-empty list of schemas, got {options!r}")
        rest = {k: v for k, v in schema.items() if k != "anyOf" and k not in ANNOTATIONS}
        if rest:
            raise SchemaError(f"{path}: anyOf next to {', '.join(sorted(rest))} is not supported (put them inside "
                              f"each option)")
        return AnyOf(tuple(compile_schema(o, f"{path}.anyOf[{i}]") for i, o in enumerate(options)))
    kind = schema.get("type")
    if kind is None:
        if set(schema) - ANNOTATIONS:
            raise SchemaError(f"{path}: give a 'type' next to {', '.join(sorted(set(schema) - ANNOTATIONS))}")
        return any_value()
    if isinstance(kind, list):
        if not kind:
            raise SchemaError(f"{path}.type: an empty list of types allows nothing")
        return AnyOf(tuple(compile_schema({**schema, "type": k}, path) for k in dict.fromkeys(kind)))
    if kind not in TYPES:
        raise SchemaError(f"{path}.type: unknown type {kind!r}; one of {', '.join(TYPES)}")
    misplaced = sorted(set(schema) & {"properties", "required", "additionalProperties"}) if kind != "object" else []
    misplaced += sorted(set(schema) & {"items", "minItems", "maxItems"}) if kind != "array" else []
    if misplaced:
        raise SchemaError(f"{path}: {', '.join(misplaced)} given for type {kind!r}")
    if kind == "string":
        return String()
    if kind in ("number", "integer"):
        return Number(integer=kind == "integer")
    if kind == "boolean":
        return Literal((b"true", b"false"))
    if kind == "null":
        return Literal((b"null",))
    if kind == "array":
        return _array(schema, path)
    return _object(schema, path)


def _array(schema: dict, path: str) -> Node:
    lo, hi = schema.get("minItems", 0), schema.get("maxItems")
    for name, v in (("minItems", lo), ("maxItems", hi)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise SchemaError(f"{path}.{name}: must be an integer >= 0, got {v!r}")
    if hi is not None and hi < lo:
        raise SchemaError(f"{path}: maxItems {hi} < minItems {lo}: no array fits")
    item = compile_schema(schema.get("items", True), f"{path}.items")
    return Array(item, lo, hi)


def _object(schema: dict, path: str) -> Node:
    extra = schema.get("additionalProperties", False if "properties" in schema else True)
    if "properties" not in schema:
        if extra is not True or schema.get("required"):
            raise SchemaError(f"{path}: an object without 'properties' is any object; required/additionalProperties "
                              f"need 'properties'")
        obj = AnyObject()
        obj.value = any_value()
        return obj
    if extra is not False:
        raise SchemaError(f"{path}.additionalProperties: only false (or absent) is supported next to 'properties' "
                          f"(the object's keys are exactly the listed ones), got {extra!r}")
    props, required = schema["properties"], schema.get("required", [])
    if not isinstance(props, dict):
        raise SchemaError(f"{path}.properties: must be an object, got {props!r}")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise SchemaError(f"{path}.required: must be a list of property names, got {required!r}")
    missing = [r for r in required if r not in props]
    if missing:
        raise SchemaError(f"{path}.required: {missing} not in properties")
    return Object(tuple(Property(k, compile_schema(v, f"{path}.properties.{k}"), k in required)
                        for k, v in props.items()))
