"""The token masks against an independent implementation: llguidance (test-only; tinyserve never imports it), on
SmolLM2's real tokenizer. At every state met along valid documents, random walks through the grammar and mutated
(invalid) texts, the set of allowed next tokens must be the library's, under the same whitespace policy (no
whitespace but one space after ',' and ':', which llguidance is told with whitespace_flexible=false and the two
separators).

One class of tokens differs by design, and is checked as such: where the grammar forces the next bytes (a key, a
separator), llguidance allows only tokens that do not split the forced text short of a longer token covering it
(after '{' with '"name": ' forced, it allows '"name' or '"' + ... only as its canonical split), while tinyserve's
mask allows every token the automaton can read, including a proper prefix of the forced text ('"', '"n', ...).
So in a forced state: the library's set is a subset of ours, and every token only we allow spells a proper prefix
of the forced bytes. Everywhere else the sets are equal. Special tokens: neither allows any but EOS, and EOS only
where the value is complete (checked with the rest). Numbers: tinyserve bounds their digits (15 before the point,
15 after, 3 in the exponent), llguidance does not, so the texts compared keep numbers shorter than that."""
from __future__ import annotations

import re

import llguidance            # the test extra installs it; tinyserve itself never imports it
import numpy as np
import pytest

from tinyserve.constrained import Vocabulary, compile_grammar, dumps

pytestmark = pytest.mark.real
V = 49152
OPTIONS = {"whitespace_flexible": False, "json_allow_general_unicode_escapes": True,
           "item_separator": ", ", "key_separator": ": "}

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "height": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
        "required": ["name", "age"], "additionalProperties": False},
    "optional-first": {"type": "object", "properties": {
        "note": {"type": "string"}, "id": {"type": "integer"}, "flag": {"type": "null"}},
        "required": ["id"], "additionalProperties": False},
    "enum-const": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue", "réd"]}, "kind": {"const": "point"},
        "n": {"enum": [1, 2.5, None, True, "x"]}}, "required": ["color", "kind", "n"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "roles": {
            "type": "array", "items": {"enum": ["admin", "dev"]}, "minItems": 1, "maxItems": 2}},
            "required": ["id", "roles"], "additionalProperties": False},
        "points": {"type": "array", "items": {"type": "array", "items": {"type": "number"}, "minItems": 2,
                                               "maxItems": 2}}},
        "required": ["user", "points"], "additionalProperties": False},
    "nullable-anyof": {"anyOf": [
        {"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"],
         "additionalProperties": False},
        {"type": "object", "properties": {"no": {"type": ["integer", "null"]}}, "required": ["no"],
         "additionalProperties": False},
        {"type": "string"}]},
    "any-json": {},
    "json-object": {"type": "object"},
    "string-array": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    # what pydantic emits: $defs/$ref, lengths, integer ranges, patterns, formats
    "pydantic": {"$defs": {
        "Color": {"enum": ["red", "green"], "title": "Color", "type": "string"},
        "Item": {"properties": {"name": {"maxLength": 8, "minLength": 2, "title": "Name", "type": "string"},
                                "qty": {"maximum": 120, "minimum": -5, "title": "Qty", "type": "integer"}},
                 "required": ["name", "qty"], "title": "Item", "type": "object", "additionalProperties": False}},
        "properties": {"color": {"$ref": "#/$defs/Color"},
                       "items": {"items": {"$ref": "#/$defs/Item"}, "maxItems": 2, "type": "array"},
                       "best": {"anyOf": [{"$ref": "#/$defs/Item"}, {"type": "null"}]}},
        "required": ["color", "items", "best"], "title": "Order", "type": "object", "additionalProperties": False},
    "ranges": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 10, "maximum": 3000}, "b": {"type": "integer", "exclusiveMinimum": -100,
                                                                       "exclusiveMaximum": 7},
        "c": {"type": "integer", "minimum": 0}, "d": {"type": "integer", "maximum": -20}},
        "required": ["a", "b", "c", "d"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "word": {"type": "string", "pattern": "^\\w+$"},
        "has_x": {"type": "string", "pattern": "x"}, "alt": {"type": "string", "pattern": "^(ab|é+|c?d)$"},
        "short": {"type": "string", "minLength": 1, "maxLength": 3}},
        "required": ["code", "word", "has_x", "alt", "short"], "additionalProperties": False},
    "formats": {"type": "object", "properties": {f: {"type": "string", "format": f} for f in
                                                  ("date", "time", "date-time", "uuid", "email")},
                "required": ["date", "time", "date-time", "uuid", "email"], "additionalProperties": False},
}

DOCUMENTS = {
    "person": [{"name": "Zoé \"Z\" 日本 🎉\n", "age": -12, "height": 1.5e3, "tags": ["a", ""], "ok": True},
               {"name": "", "age": 0}, {"name": "x", "age": 10, "ok": False}],
    "optional-first": [{"note": "hi\\there", "id": 3, "flag": None}, {"id": -7}],
    "enum-const": [{"color": "réd", "kind": "point", "n": 2.5}, {"color": "blue", "kind": "point", "n": None}],
    "nested": [{"user": {"id": 1, "roles": ["admin", "dev"]}, "points": [[1, -2.25], [0.001, 1e-7]]},
               {"user": {"id": 22, "roles": ["dev"]}, "points": []}],
    "nullable-anyof": [{"yes": True}, {"no": None}, {"no": 12}, "just a string"],
    "any-json": [[1, {"a": [True, None, "x"]}, -0.5, "é"], {"k": {"k": {"k": []}}}, 3.25e-10, "s", None],
    "json-object": [{"a": 1, "b": [{"c": "d"}]}, {}],
    "string-array": [["a", "b c", "ünï"], []],
    "pydantic": [{"color": "red", "items": [{"name": "ab", "qty": -5}, {"name": "éééééééé", "qty": 120}],
                  "best": None}, {"color": "green", "items": [], "best": {"name": "xyz", "qty": 7}}],
    "ranges": [{"a": 10, "b": -99, "c": 0, "d": -20}, {"a": 2999, "b": 6, "c": 123456, "d": -1234}],
    "pattern": [{"code": "AB-123", "word": "hello_1", "has_x": "a x b", "alt": "éé", "short": "é\n"},
                {"code": "ZZ-000", "word": "Q", "has_x": "x", "alt": "d", "short": "abc"}],
    "formats": [{"date": "2024-02-29", "time": "23:59:60.5Z", "date-time": "1999-12-31T00:00:00+01:00",
                 "uuid": "123e4567-e89b-12d3-A456-426614174000", "email": "a.b+c@example.co"}],
}


@pytest.fixture(scope="module")
def lib_tokenizer(smol_tok):
    from tinyserve.weights import DEFAULT_WEIGHTS_DIR
    text = (DEFAULT_WEIGHTS_DIR / "tokenizer.json").read_text()
    return llguidance.LLTokenizer(text, n_vocab=V, eos_token=smol_tok.eos_id)


@pytest.fixture(scope="module")
def vocab(smol_tok):
    return Vocabulary.of(smol_tok, V, [smol_tok.eos_id])


class Pair:
    """Our state and the library's matcher, advanced together."""
    def __init__(self, schema, vocab, lib_tokenizer, grammar=None):
        self.grammar = grammar or compile_grammar(schema, vocab)
        self.ours = self.grammar.start()
        self.lib = llguidance.LLMatcher(lib_tokenizer,
                                        llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=OPTIONS))
        assert not self.lib.is_error(), self.lib.get_error()

    def lib_mask(self) -> np.ndarray:                                            # [V] bool
        bits = np.frombuffer(self.lib.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:V].astype(bool)

    def compare(self, where: str) -> np.ndarray:
        """Assert the two masks agree (as the module docstring defines); return the tokens both allow."""
        ours, lib = self.ours.allowed(), self.lib_mask()
        forced = self.grammar.automaton.forced(self.ours.state)
        only_ours, only_lib = np.flatnonzero(ours & ~lib), np.flatnonzero(lib & ~ours)
        tb = self.grammar.vocab.token_bytes
        assert len(only_lib) == 0, f"{where}: the library allows {[tb[t] for t in only_lib[:8]]} too"
        if forced:
            bad = [tb[t] for t in only_ours if not (tb[t] and len(tb[t]) < len(forced) and forced.startswith(tb[t]))]
            assert not bad, f"{where}: we allow {bad[:8]} and the library does not (forced {forced!r})"
        else:
            assert len(only_ours) == 0, f"{where}: we allow {[tb[t] for t in only_ours[:8]]}, the library does not"
        return np.flatnonzero(ours & lib)

    def advance(self, token: int) -> None:
        self.ours.advance(token)
        assert self.lib.consume_token(token), self.lib.get_error()


@pytest.mark.parametrize("name", SCHEMAS)
def test_masks_equal_along_valid_documents(name, vocab, lib_tokenizer, smol_tok):
    grammar = compile_grammar(SCHEMAS[name], vocab)
    for doc in DOCUMENTS[name]:
        text = dumps(doc)
        pair = Pair(SCHEMAS[name], vocab, lib_tokenizer, grammar)
        ids = smol_tok.encode(text)
        for i, t in enumerate(ids):
            pair.compare(f"{name} after {smol_tok.decode(ids[:i])!r}")
            pair.advance(t)
        pair.compare(f"{name} at the end of {text!r}")
        assert pair.ours.complete and pair.lib.is_accepting()
        assert pair.ours.allowed()[smol_tok.eos_id]


def too_long_number(data: bytes) -> bool:
    """The text ends in a digit run near tinyserve's bound (13+ digits, or an exponent of 3+)."""
    return re.search(rb"(\d{13,}|[eE][+-]?\d{3,})$", data) is not None


@pytest.mark.parametrize("name", SCHEMAS)
def test_masks_equal_along_random_walks(name, vocab, lib_tokenizer):
    """Random token paths through the grammar (not the tokenizer's own splits: partial UTF-8 tokens, odd merges),
    biased towards structural tokens so that walks get somewhere."""
    rng = np.random.default_rng(sum(map(ord, name)))
    grammar = compile_grammar(SCHEMAS[name], vocab)
    structural = np.array([bool(b) and any(c in b for c in b'",:}]{[0123456789') for b in vocab.token_bytes])
    taken = 0
    for walk in range(4):
        pair, text = Pair(SCHEMAS[name], vocab, lib_tokenizer, grammar), b""
        for step in range(50):
            both = pair.compare(f"{name} walk {walk} step {step}")
            both = both[both != lib_tokenizer.eos_token] if len(both) > 1 else both
            if len(both) == 0 or pair.ours.finished:
                break
            pick = both[structural[both]] if rng.random() < 0.6 and structural[both].any() else both
            for _ in range(20):                # keep digit runs inside tinyserve's number bound (see above)
                token = int(rng.choice(pick))
                if token == lib_tokenizer.eos_token or not too_long_number(text + vocab.token_bytes[token]):
                    break
            if token == lib_tokenizer.eos_token or too_long_number(text + vocab.token_bytes[token]):
                break
            text += vocab.token_bytes[token]
            pair.advance(token)
            taken += 1
    assert taken >= 20, f"the walks took only {taken} tokens: they test little"


@pytest.mark.parametrize("name", SCHEMAS)
def test_invalid_texts_are_cut_at_the_same_token(name, vocab, lib_tokenizer, smol_tok):
    """Mutated documents (a character inserted, deleted or replaced): both accept the same number of tokens, and
    agree on the mask where they stop."""
    rng = np.random.default_rng(1 + sum(map(ord, name)))
    grammar = compile_grammar(SCHEMAS[name], vocab)
    alphabet = ' {}[]",:0123456789.-eEtrufalsnxé\\'
    for doc in DOCUMENTS[name]:
        text = dumps(doc)
        for _ in range(6):
            i = int(rng.integers(0, len(text) + 1))
            c = alphabet[int(rng.integers(len(alphabet)))]
            op = rng.integers(3)
            bad = text[:i] + c + text[i:] if op == 0 else text[:i] + text[i + 1:] if op == 1 else \
                text[:i] + c + text[i + 1:]
            ids = smol_tok.encode(bad)
            pair = Pair(SCHEMAS[name], vocab, lib_tokenizer, grammar)
            n_ours, n_lib = pair.ours.valid_prefix(ids), pair.lib.validate_tokens(ids)
            assert n_ours == n_lib, f"{name}: {bad!r}: we accept {n_ours} tokens, the library {n_lib}"
            for t in ids[:n_ours]:
                pair.advance(t)
            pair.compare(f"{name}: where {bad!r} goes wrong")
