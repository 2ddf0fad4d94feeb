"""A JSON Schema subset -> the grammar nodes of automaton.py, within a budget.

Supported: `type` (string, number, integer, boolean, null, object, array, or a list of them), `properties` with
`required` (an object's keys come out in the order `properties` lists them; no other keys: `additionalProperties`
may only be absent or false), `items` with `minItems`/`maxItems`, `enum`, `const`, `anyOf` (and `oneOf`, see below), nesting of all of these, the empty schema / `true` (any JSON value), and:

  - `$defs` / `definitions` with `$ref` to them ("#/$defs/Name", "#/definitions/Name", "#"): what pydantic emits
    for nested models, Enum classes and `list[Item]`. A recursive reference (a model that contains itself) is
    refused: its language is not regular at a bounded cost without choosing a depth, and a silent depth would
    cut valid answers;
  - `minLength` / `maxLength` on strings (in characters), `pattern` (regex.py's subset, refused clearly beyond it),
    `format` date, time, date-time, uuid, email (as regular languages; other formats are refused);
  - `minimum` / `maximum` / `exclusiveMinimum` / `exclusiveMaximum` on integers and numbers, enforced exactly
    (rational arithmetic on the decimal text); a bounded number is written without an exponent.

`oneOf` is read as `anyOf` only when its options begin with different bytes (so no value can match two of them):
exclusion ("exactly one") cannot be enforced by choice alone. Refused with a SchemaError naming the keyword:
`allOf`/`not`/`if` (intersection or exclusion), `patternProperties`, `additionalProperties` other than false,
`multipleOf`, `uniqueItems`, `prefixItems`, `false`, and any other keyword that would change what is valid.

The budget (a schema comes from a request body: its compile must never stall the server). Checked while compiling,
before any automaton state exists, each refusal a SchemaError naming the limit:
  - nesting at most MAX_DEPTH schemas deep (the compiler recurses that deep, never deeper),
  - at most MAX_SCHEMAS sub-schemas visited in all (compile time is linear in them) and MAX_ENUM_VALUES enum/const
    values, MAX_LITERAL_BYTES of their text,
  - identical sub-schemas compile to one node (hash-consing), so a schema that repeats itself costs its distinct
    parts only,
  - the *width*: an upper bound on how many parses one automaton state can hold at once (the stacks the lazily
    determinised automaton tracks: an `anyOf` of options starting with the same byte keeps both alive, and
    nesting multiplies). It is at most MAX_WIDTH; beyond it the mask work per state would grow without bound.
"""
from __future__ import annotations

import json
from fractions import Fraction

from .automaton import ITEM_SEP, KEY_SEP, AnyObject, AnyOf, Array, BoundedNumber, Literal, Node, Number, Object, \
    PatternString, Property, String, any_value
from .regex import FORMATS, compile_regex

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "discriminator", "$defs", "definitions"})
SUPPORTED = frozenset({"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                       "enum", "const", "anyOf", "oneOf", "$ref", "minLength", "maxLength", "pattern", "format",
                       "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
STRING_KEYS = frozenset({"minLength", "maxLength", "pattern", "format"})
NUMBER_KEYS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})

MAX_DEPTH = 32                 # schemas nested in schemas (OpenAI allows 10 levels of objects)
MAX_SCHEMAS = 5000             # sub-schemas visited (OpenAI allows 5,000 properties)
MAX_ENUM_VALUES = 1000         # enum and const values in all (OpenAI: 1,000)
MAX_LITERAL_BYTES = 120_000    # their text in all (OpenAI: 120,000 characters)
MAX_WIDTH = 64                 # parses one automaton state may hold (see the module docstring)


class SchemaError(ValueError):
    """The schema uses something this grammar compiler does not support, is not a valid schema, or is over the
    budget."""


def dumps(value) -> str:
    """A JSON value in the layout the grammar produces (no whitespace but one space after ',' and ':')."""
    return json.dumps(value, ensure_ascii=False, separators=(ITEM_SEP.decode(), KEY_SEP.decode()), allow_nan=False)


def compile_schema(schema, path: str = "$") -> Node:
    """The grammar node for `schema` (a dict, or True for any value). `path` names the place in error messages."""
    compiler = _Compiler(schema)
    node = compiler.compile(schema, path, 0)
    width = grammar_width(node)
    if width > MAX_WIDTH:
        raise SchemaError(f"{path}: the schema is too ambiguous: one point of the text may be read {width} ways at "
                          f"once (anyOf options that begin alike, nested in each other); the limit is {MAX_WIDTH}")
    return node


class _Compiler:
    def __init__(self, root):
        self.root = root
        self.defs = {}
        if isinstance(root, dict):
            for key in ("$defs", "definitions"):
                d = root.get(key, {})
                if not isinstance(d, dict):
                    raise SchemaError(f"$.{key}: must be an object of named schemas, got {type(d).__name__}")
                self.defs.update({f"#/{key}/{name}": s for name, s in d.items()})
        self.visited = 0
        self.literals = 0
        self.literal_bytes = 0
        self.interned: dict[tuple, Node] = {}     # structure -> node: identical sub-schemas share one node
        self.resolving: list[str] = []             # the $refs being expanded (a cycle is a recursive schema)
        self.by_ref: dict[str, Node] = {}

    def intern(self, key: tuple, make) -> Node:
        node = self.interned.get(key)
        if node is None:
            node = self.interned[key] = make()
        return node

    def compile(self, schema, path: str, depth: int) -> Node:
        if depth > MAX_DEPTH:
            raise SchemaError(f"{path}: the schema nests deeper than {MAX_DEPTH} levels")
        self.visited += 1
        if self.visited > MAX_SCHEMAS:
            raise SchemaError(f"{path}: the schema has more than {MAX_SCHEMAS} sub-schemas")
        if schema is True or schema == {}:
            return self.intern(("any",), any_value)
        if not isinstance(schema, dict):
            raise SchemaError(f"{path}: a schema must be an object (or true), got {_short(schema)}")
        unknown = sorted(set(schema) - SUPPORTED - ANNOTATIONS)
        if unknown:
            raise SchemaError(f"{path}: unsupported JSON Schema keyword(s) {', '.join(map(repr, unknown))}; "
                              f"supported: {', '.join(sorted(SUPPORTED))} (and annotations such as title, "
                              f"description)")
        if "$ref" in schema:
            return self.ref(schema, path, depth)
        if "const" in schema:
            return self.literal([schema["const"]], f"{path}.const")
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{path}.enum: must be a non-empty list, got {_short(values)}")
            return self.literal(values, f"{path}.enum")
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.any_of(schema, key, path, depth)
        kind = schema.get("type")
        if kind is None:
            if set(schema) - ANNOTATIONS:
                raise SchemaError(f"{path}: give a 'type' next to {', '.join(sorted(set(schema) - ANNOTATIONS))}")
            return self.intern(("any",), any_value)
        if isinstance(kind, list):
            if not kind or not all(isinstance(k, str) for k in kind):
                raise SchemaError(f"{path}.type: a list of types must hold type names, got {_short(kind)}")
            options = [self.compile({**schema, "type": k}, path, depth + 1) for k in dict.fromkeys(kind)]
            return options[0] if len(options) == 1 else self.intern(("anyOf", tuple(map(id, options))),
                                                                     lambda: AnyOf(tuple(options)))
        if kind not in TYPES:
            raise SchemaError(f"{path}.type: unknown type {_short(kind)}; one of {', '.join(TYPES)}")
        misplaced = sorted(set(schema) & {"properties", "required", "additionalProperties"}) if kind != "object" \
            else []
        misplaced += sorted(set(schema) & {"items", "minItems", "maxItems"}) if kind != "array" else []
        misplaced += sorted(set(schema) & STRING_KEYS) if kind != "string" else []
        misplaced += sorted(set(schema) & NUMBER_KEYS) if kind not in ("number", "integer") else []
        if misplaced:
            raise SchemaError(f"{path}: {', '.join(misplaced)} given for type {kind!r}")
        if kind == "string":
            return self.string(schema, path)
        if kind in ("number", "integer"):
            return self.number(schema, kind == "integer", path)
        if kind == "boolean":
            return self.intern(("bool",), lambda: Literal((b"true", b"false")))
        if kind == "null":
            return self.intern(("null",), lambda: Literal((b"null",)))
        if kind == "array":
            return self.array(schema, path, depth)
        return self.object(schema, path, depth)

    def ref(self, schema: dict, path: str, depth: int) -> Node:
        ref = schema["$ref"]
        rest = set(schema) - {"$ref"} - ANNOTATIONS
        if rest:
            raise SchemaError(f"{path}: $ref next to {', '.join(sorted(rest))} is not supported")
        if not isinstance(ref, str):
            raise SchemaError(f"{path}.$ref: must be a string, got {_short(ref)}")
        if ref in self.by_ref:
            return self.by_ref[ref]
        if ref in self.resolving:
            raise SchemaError(f"{path}.$ref: {ref!r} refers to itself (a recursive schema); recursive schemas are "
                              f"not supported: unroll it to the depth you need")
        if ref == "#":
            target = self.root
        elif ref in self.defs:
            target = self.defs[ref]
        else:
            raise SchemaError(f"{path}.$ref: {ref!r} is not in this schema's $defs (only local references "
                              f"'#/$defs/Name', '#/definitions/Name' and '#' are supported)")
        self.resolving.append(ref)
        try:
            node = self.compile(target, ref, depth + 1)
        finally:
            self.resolving.pop()
        self.by_ref[ref] = node
        return node

    def literal(self, values: list, path: str) -> Node:
        self.literals += len(values)
        if self.literals > MAX_ENUM_VALUES:
            raise SchemaError(f"{path}: more than {MAX_ENUM_VALUES} enum/const values in the schema")
        try:
            texts = tuple(dict.fromkeys(dumps(v).encode() for v in values))
        except (TypeError, ValueError, RecursionError) as e:
            raise SchemaError(f"{path}: a value that is not JSON (NaN and Infinity are not JSON): {e}") from None
        self.literal_bytes += sum(map(len, texts))
        if self.literal_bytes > MAX_LITERAL_BYTES:
            raise SchemaError(f"{path}: more than {MAX_LITERAL_BYTES} bytes of enum/const values in the schema")
        return self.intern(("lit", texts), lambda: Literal(texts))

    def any_of(self, schema: dict, key: str, path: str, depth: int) -> Node:
        options = schema[key]
        if not isinstance(options, list) or not options:
            raise SchemaError(f"{path}.{key}: must be a non-empty list of schemas, got {_short(options)}")
        rest = {k for k in schema if k != key and k not in ANNOTATIONS}
        if rest:
            raise SchemaError(f"{path}: {key} next to {', '.join(sorted(rest))} is not supported (put them inside "
                              f"each option)")
        nodes = list(dict.fromkeys(self.compile(o, f"{path}.{key}[{i}]", depth + 1) for i, o in enumerate(options)))
        if key == "oneOf":                       # "exactly one": only choice-safe when no value fits two options
            firsts = [first_bytes(n, {}) for n in nodes]
            if len(nodes) < len(options) or sum(map(len, firsts)) != len(frozenset().union(*firsts)):
                raise SchemaError(f"{path}.oneOf: only options that cannot match the same value (different types, "
                                  f"as in {{'oneOf': [{{'type': 'string'}}, {{'type': 'integer'}}]}}) are supported; "
                                  f"use anyOf if a value may match several")
        if len(nodes) == 1:
            return nodes[0]
        return self.intern(("anyOf", tuple(map(id, nodes))), lambda: AnyOf(tuple(nodes)))

    def string(self, schema: dict, path: str) -> Node:
        lo, hi = _count(schema, "minLength", path, 0), _count(schema, "maxLength", path, None)
        if hi is not None and hi < lo:
            raise SchemaError(f"{path}: maxLength {hi} < minLength {lo}: no string fits")
        pattern, fmt = schema.get("pattern"), schema.get("format")
        if pattern is not None and fmt is not None:
            raise SchemaError(f"{path}: pattern together with format is not supported (use one)")
        if fmt is not None:
            if fmt not in FORMATS:
                raise SchemaError(f"{path}.format: {_short(fmt)} is not supported; supported: "
                                  f"{', '.join(FORMATS)}")
            pattern = FORMATS[fmt]
        if pattern is None:
            return self.intern(("str", lo, hi), lambda: String(lo, hi))
        try:
            nfa = compile_regex(pattern)
        except ValueError as e:
            raise SchemaError(f"{path}.{'format' if fmt else 'pattern'}: {e}") from None
        return self.intern(("pat", pattern, lo, hi), lambda: PatternString(nfa, lo, hi))

    def number(self, schema: dict, integer: bool, path: str) -> Node:
        if not set(schema) & NUMBER_KEYS:
            return self.intern(("num", integer), lambda: Number(integer=integer))
        bounds = {}
        for key in NUMBER_KEYS & set(schema):
            v = schema[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), -float("inf")):
                raise SchemaError(f"{path}.{key}: must be a finite number, got {_short(v)}")
            bounds[key] = Fraction(v)
        lo, lo_open = _tighter(bounds.get("minimum"), bounds.get("exclusiveMinimum"), max)
        hi, hi_open = _tighter(bounds.get("maximum"), bounds.get("exclusiveMaximum"), min)
        node = BoundedNumber(lo, hi, integer, lo_open, hi_open)
        if not node._reachable(b""):
            raise SchemaError(f"{path}: no {'integer' if integer else 'number'} lies within its minimum/maximum")
        return self.intern(("bnum", lo, hi, integer, lo_open, hi_open), lambda: node)

    def array(self, schema: dict, path: str, depth: int) -> Node:
        lo, hi = _count(schema, "minItems", path, 0), _count(schema, "maxItems", path, None)
        if hi is not None and hi < lo:
            raise SchemaError(f"{path}: maxItems {hi} < minItems {lo}: no array fits")
        item = self.compile(schema.get("items", True), f"{path}.items", depth + 1)
        return self.intern(("arr", id(item), lo, hi), lambda: Array(item, lo, hi))

    def object(self, schema: dict, path: str, depth: int) -> Node:
        extra = schema.get("additionalProperties", False if "properties" in schema else True)
        if "properties" not in schema:
            if extra is not True or schema.get("required"):
                raise SchemaError(f"{path}: an object without 'properties' is any object; required/"
                                  f"additionalProperties need 'properties'")
            return self.intern(("anyobj",), _any_object)
        if extra is not False:
            raise SchemaError(f"{path}.additionalProperties: only false (or absent) is supported next to "
                              f"'properties' (the object's keys are exactly the listed ones), got {_short(extra)}")
        props, required = schema["properties"], schema.get("required", [])
        if not isinstance(props, dict):
            raise SchemaError(f"{path}.properties: must be an object, got {_short(props)}")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{path}.required: must be a list of property names, got {_short(required)}")
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(f"{path}.required: {missing[:5]} not in properties")
        fields = tuple(Property(k, self.compile(v, f"{path}.properties.{k}", depth + 1), k in required)
                       for k, v in props.items())
        return self.intern(("obj", tuple((p.key, id(p.value), p.required) for p in fields)),
                           lambda: Object(fields))


def _any_object() -> Node:
    obj = AnyObject()
    obj.value = any_value()
    return obj


def _count(schema: dict, name: str, path: str, default):
    v = schema.get(name, default)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise SchemaError(f"{path}.{name}: must be an integer >= 0, got {_short(v)}")
    if v is not None and v > 100_000:
        raise SchemaError(f"{path}.{name}: {v} is above this server's limit of 100000")
    return v


def _tighter(inclusive, exclusive, pick):
    """One bound from JSON Schema's inclusive and exclusive forms: (value, open?). `pick` is max for a lower bound,
    min for an upper one; at equal values the exclusive form is the tighter."""
    if exclusive is None:
        return inclusive, False
    if inclusive is None or pick(inclusive, exclusive) == exclusive:
        return exclusive, True
    return inclusive, False


def _short(value, limit: int = 80) -> str:
    """A value for an error message, cut to `limit` characters (a schema may be megabytes)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(type(value).__name__)
    return text if len(text) <= limit else text[:limit] + "..."


# --- the width: how many parses one state may hold -----------------------------------------------------------------

def first_bytes(node: Node, memo: dict) -> frozenset:
    """The bytes a value of `node` may begin with."""
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = frozenset()                          # a cycle (the "any value" node) contributes via its options
    if isinstance(node, Literal):
        out = frozenset(o[0] for o in node.options if o)
    elif isinstance(node, (String, PatternString)):
        out = frozenset((0x22,))
    elif isinstance(node, (Number, BoundedNumber)):
        out = frozenset(b"-0123456789")
    elif isinstance(node, Array):
        out = frozenset((0x5B,))
    elif isinstance(node, (Object, AnyObject)):
        out = frozenset((0x7B,))
    elif isinstance(node, AnyOf):
        out = frozenset().union(*(first_bytes(o, memo) for o in node.options))
    else:
        out = frozenset(range(256))
    memo[key] = out
    return out


def grammar_width(root: Node) -> int:
    """An upper bound on the stacks one automaton state holds: an AnyOf keeps alive, for a byte, every option
    that may begin with it (so its width is the largest sum of its options' widths over one first byte); a
    container is as wide as its widest child (one child is open at a time). Cycles (any JSON value) count 1 per
    visit: their options begin with distinct bytes."""
    firsts: dict = {}
    memo: dict[int, int] = {}

    def width(node: Node) -> int:
        key = id(node)
        if key in memo:
            return memo[key]
        memo[key] = 1                                # on a cycle
        if isinstance(node, AnyOf):
            by_byte: dict[int, int] = {}
            for o in node.options:
                w = width(o)
                for b in first_bytes(o, firsts):
                    by_byte[b] = by_byte.get(b, 0) + w
            out = max(by_byte.values(), default=1)
        elif isinstance(node, Array):
            out = width(node.item)
        elif isinstance(node, Object):
            out = max((width(p.value) for p in node.props), default=1)
        elif isinstance(node, AnyObject):
            out = width(node.value)
        else:
            out = 1
        memo[key] = min(out, 1 << 30)
        return memo[key]

    return width(root)
