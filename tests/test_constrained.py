"""Constrained decoding, without a model: the JSON automaton, the schema compiler, the token masks."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tinyserve.constrained import Automaton, SchemaError, Vocabulary, compile_grammar, compile_schema, dumps
from tinyserve.tokenizer import CharTokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age"]}


def accepts(schema, text: str) -> bool:
    return Automaton(compile_schema(schema)).matches(text.encode())


@pytest.mark.parametrize("text", ['{"name": "Bob", "age": 3}', '{"name": "", "age": -10, "ok": false}',
                                  '{"name": "é\\"\\u00e9\\n", "age": 0, "tags": ["a", "b"], "ok": true}',
                                  '{"name": "x", "age": 1, "tags": []}'])
def test_schema_accepts_its_documents(text):
    assert accepts(PERSON, text)


@pytest.mark.parametrize("text", ['{"name": "Bob"}',                        # a required key missing
                                  '{"age": 3, "name": "Bob"}',              # keys out of schema order
                                  '{"name": "Bob", "age": 3.5}',            # integer with a fraction
                                  '{"name": "Bob", "age": 03}',             # a leading zero
                                  '{"name":"Bob", "age": 3}',               # whitespace off the policy
                                  '{"name": "Bob", "age": 3, "x": 1}',      # a key the schema does not list
                                  '{"name": "a\tb", "age": 3}',             # a raw control character
                                  '{"name": "Bob", "age": 3} '])            # trailing whitespace
def test_schema_rejects_other_text(text):
    assert not accepts(PERSON, text)


@pytest.mark.parametrize("text,ok", [('[1, {"a": [true, null, "x"]}, -0.5e+3]', True), ("{}", True), ("[]", True),
                                     ('"\\u00e9"', True), ("1.", False), ('{"a":1}', False), ("-", False),
                                     ("1e5", True), ('"\\x"', False), ("nul", False)])
def test_any_json_value(text, ok):
    assert accepts(True, text) is ok
    if ok:
        json.loads(text)


@pytest.mark.parametrize("text,ok", [("0", True), ("-0", True), ("01", False), ("1.5", True), ("1.", False),
                                     (".5", False), ("1E+05", True), ("1e", False), ("1" * 15, True),
                                     ("1" * 16, False), ("1." + "2" * 15, True), ("1." + "2" * 16, False),
                                     ("1e123", True), ("1e1234", False), ("-12.5e-3", True)])
def test_numbers_and_their_digit_bound(text, ok):
    """JSON's number syntax, with at most 15 + 15 + 3 digits: a greedy model must not write digits forever."""
    assert accepts({"type": "number"}, text) is ok
    assert accepts({"type": "integer"}, text) is (ok and text.lstrip("-").isdigit())


def test_utf8_is_checked_byte_by_byte():
    a = Automaton(compile_schema({"type": "string"}))
    assert a.matches('"ü€😀"'.encode())
    for bad in (b'"\xc3"', b'"\xc0\x80"', b'"\xed\xa0\x80"', b'"\xf4\x90\x80\x80"', b'"\xff"'):
        assert not a.matches(bad), bad           # cut, overlong, surrogate, beyond U+10FFFF, never a lead byte


@pytest.mark.parametrize("text,ok", [(r'"\uD83D\uDE00"', True), (r'"\ud83d\ude00"', True), (r'"\uD7FF\uE000"', True),
                                     (r'"\uD83D"', False), (r'"\uDE00"', False), (r'"\uD83Dx"', False),
                                     (r'"\uD83D\u0041"', False), (r'"\/"', False), ('"\x7f"', False),
                                     (r'"\u00"', False)])
def test_string_escapes_policy(text, ok):
    """Surrogate escapes only as a pair, no \\/ and no raw DEL (llguidance's rules; raw UTF-8 says it all)."""
    assert accepts({"type": "string"}, text) is ok


def test_enum_const_anyof_and_bounds():
    assert accepts({"enum": ["red", 1, None]}, "null") and not accepts({"enum": ["red", 1, None]}, '"re"')
    assert accepts({"const": {"a": [1]}}, '{"a": [1]}')
    assert accepts({"type": ["string", "null"]}, "null") and accepts({"anyOf": [{"type": "integer"}]}, "7")
    arr = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}
    assert [accepts(arr, t) for t in ("[]", "[1]", "[1, 2]", "[1, 2, 3]")] == [False, True, True, False]


@pytest.mark.parametrize("schema,word", [({"$ref": "#/a"}, "$ref"), ({"oneOf": [{}, {"type": "string"}]}, "oneOf"),
                                         ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
                                         ({"type": "string", "pattern": "(?=a)"}, "pattern"),
                                         ({"type": "string", "format": "hostname"}, "format"),
                                         ({"type": "object", "patternProperties": {}}, "patternProperties"),
                                         ({"type": "object", "properties": {}, "additionalProperties": True},
                                          "additionalProperties"),
                                         ({"type": "object", "properties": {}, "required": ["x"]}, "required"),
                                         ({"type": "tuple"}, "tuple"), (False, "schema")])
def test_unsupported_schemas_are_refused_by_name(schema, word):
    with pytest.raises(SchemaError, match=word.replace("$", r"\$")):
        compile_schema(schema)


def char_vocab():
    tok = CharTokenizer()
    return Vocabulary.of(tok, 256, [tok.eos_id])


def test_masks_are_exactly_the_readable_tokens():
    """On the character vocabulary, the mask must equal "the automaton can read this character" for every state
    met along a document, with EOS only at the end."""
    g = compile_grammar(PERSON, char_vocab())
    state = g.start()
    text = '{"name": "Zoé", "age": 42, "ok": true}'
    for ch in text:
        m = state.allowed()
        want = np.zeros(256, bool)
        for i in range(3, 256):
            want[i] = g.automaton.walk(state.state, chr(i).encode()) != -1
        assert (m == want).all(), ch
        state.advance(ord(ch))
    assert state.complete and state.finished and state.allowed()[2]


def test_plain_token_shortcut_gives_the_full_walks_mask():
    g = compile_grammar({"anyOf": [PERSON, {"type": "array", "items": {"type": "string"}}]}, char_vocab())
    sid = g.automaton.walk(g.automaton.start, b'{"name": "a')
    assert (g.compute_mask(sid) == g.compute_mask(sid, use_plain=False)).all()


def test_advance_refuses_a_token_the_mask_did_not_allow():
    state = compile_grammar(PERSON, char_vocab()).start()
    with pytest.raises(ValueError, match="not allowed"):
        state.advance(ord("["))
    with pytest.raises(ValueError, match="EOS"):
        state.advance(2)


def test_forced_bytes_and_dumps_layout():
    a = Automaton(compile_schema(PERSON))
    assert a.forced(a.start) == b'{"name": "'
    assert a.forced(a.walk(a.start, b'{"name": "x"')) == b', "age": '   # age is required: all forced
    assert dumps({"a": [1, 2]}) == '{"a": [1, 2]}'
