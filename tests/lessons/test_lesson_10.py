"""Lesson 10 self-checks: structured output — the token mask, the plain tokens inside a string, the trie walk.

`make check-10` runs these against lessons/10_structured_output/exercises.py; `make test` runs them against
tinyserve/constrained/. They need no model: a small vocabulary and the JSON automaton are enough.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.lessons.impl import load_impl
from tinyserve.constrained import Automaton, compile_schema
from tinyserve.constrained.automaton import DEAD
from tinyserve.constrained.vocab import build_trie

REFERENCE = {
    "apply_mask": "tinyserve.constrained.masks:apply_mask",
    "is_plain": "tinyserve.constrained.vocab:is_plain",
    "walk_trie": "tinyserve.constrained.masks:walk_trie",
    "auto_schema": "tinyserve.tool_calls:auto_schema",
}
impl = load_impl(10, REFERENCE)

# a tiny vocabulary: tokens that are prefixes of others, tokens that straddle grammar symbols ('":', '", "'),
# half a UTF-8 character ('\xc3'), its other half ('\xa9')
VOCAB = [b"{", b"}", b'"', b'{"', b'":', b'": ', b", ", b'", "', b"t", b"tr", b"true", b"false", b"a", b"ab",
         b"1", b"12", b"-", b"\xc3", b"\xa9", b"\xc3\xa9", b" ", b"\\", b'\\"', b"\n", b"ok"]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "ab": {"type": "string"},
                                           "n": {"type": "integer"}}, "required": ["ok"]}


# --- apply_mask ----------------------------------------------------------------------------------------------

@pytest.mark.exercise("apply_mask")
def test_disallowed_tokens_get_minus_infinity_and_allowed_keep_their_logit():
    logits = np.array([3.0, -5.0, 0.0, 2.5], dtype=np.float32)
    out = impl.apply_mask(logits, np.array([False, True, False, True]))
    assert out[0] == -np.inf and out[2] == -np.inf, "a disallowed token must become impossible: -inf, not 0"
    assert out[1] == -5.0 and out[3] == 2.5, "allowed tokens keep their logits unchanged"
    assert out.dtype == np.float32 and out.shape == (4,)
    assert logits[0] == 3.0, "do not change the caller's logits in place"


@pytest.mark.exercise("apply_mask")
def test_greedy_and_sampling_pick_only_allowed_tokens():
    # a 0 for the disallowed tokens would let the disallowed 0-logit token beat every (negative) allowed one
    logits = np.array([-1.0, 0.0, -3.0, -2.0])
    allowed = np.array([True, False, False, True])
    out = impl.apply_mask(logits, allowed)
    assert int(np.argmax(out)) == 0
    p = np.exp(out - out.max())
    p /= p.sum()
    assert p[1] == 0 and p[2] == 0 and p[0] == pytest.approx(1 / (1 + np.exp(-1.0)))


# --- is_plain --------------------------------------------------------------------------------------------------

@pytest.mark.exercise("is_plain")
@pytest.mark.parametrize("data, plain", [(b"hello", True), (b" the", True), ("é".encode(), True),
                                         ("日本".encode(), True), (b"~", True), (b" ", True),
                                         (b"a b", True)])
def test_whole_characters_without_quote_or_backslash_are_plain(data, plain):
    assert impl.is_plain(data) is plain


@pytest.mark.exercise("is_plain")
@pytest.mark.parametrize("data, why", [(b'a"', "a quote ends the string"), (b"\\n", "a backslash starts an escape"),
                                       (b"a\n", "a raw newline is not allowed in a JSON string"),
                                       (b"\t", "nor a tab (any byte < 0x20)"), (b"\x7f", "nor DEL (0x7f)"),
                                       (b"a\x01", "nor U+0001: every byte below 0x20, not only \\b \\f \\n \\r \\t"),
                                       (b"\x1f", "nor U+001F, the last control character (0x1f < 0x20)"),
                                       (b"\xc3", "half of 'é': the string body is left mid-character"),
                                       (b"\xa9", "a continuation byte alone"), (b"\xff", "never valid UTF-8")])
def test_these_are_not_plain(data, why):
    assert impl.is_plain(data) is False, why


# --- walk_trie -------------------------------------------------------------------------------------------------

def brute_force(a: Automaton, sid: int) -> set[int]:
    """The definition: token i is allowed if the automaton reads all of its bytes from state sid."""
    return {i for i, data in enumerate(VOCAB) if a.walk(sid, data) != DEAD}


def states_along(a: Automaton, text: bytes) -> list[int]:
    sids, sid = [a.start], a.start
    for b in text:
        sid = a.next(sid, b)
        sids.append(sid)
    return sids


@pytest.mark.exercise("walk_trie")
@pytest.mark.parametrize("schema, text", [(SCHEMA, b'{"ok": true, "ab": "a\\"\xc3\xa9", "n": -12}'),
                                          (True, b'[1, {"ab": [true, "\xc3\xa9"]}, -1]')])
def test_the_walk_finds_exactly_the_readable_tokens_in_every_state(schema, text):
    a = Automaton(compile_schema(schema))
    trie = build_trie(enumerate(VOCAB))
    for sid in states_along(a, text):
        out: list[int] = []
        impl.walk_trie(trie, a, sid, out)
        assert sorted(out) == sorted(brute_force(a, sid)), (
            f"in state {list(a.describe(sid))}: got {sorted(VOCAB[i] for i in out)}, want "
            f"{sorted(VOCAB[i] for i in brute_force(a, sid))}")


@pytest.mark.exercise("walk_trie")
def test_tokens_inside_the_trie_count_not_only_its_leaves():
    a = Automaton(compile_schema({"type": "boolean"}))
    out: list[int] = []
    impl.walk_trie(build_trie(enumerate(VOCAB)), a, a.start, out)
    assert sorted(VOCAB[i] for i in out) == [b"false", b"t", b"tr", b"true"], \
        "'t' and 'tr' end at inner nodes of the trie (they are prefixes of 'true'): they are tokens too"


@pytest.mark.exercise("walk_trie")
def test_the_walk_stops_at_the_first_impossible_byte():
    """After '{' only '"' and '}' may follow: the walk must not go down any other subtree."""
    a = Automaton(compile_schema(SCHEMA))
    sid = a.walk(a.start, b"{")
    visited = []

    class Spy:
        def next(self, s, b):
            visited.append(b)
            return a.next(s, b)

        def __getattr__(self, name):
            return getattr(a, name)

    out: list[int] = []
    impl.walk_trie(build_trie(enumerate(VOCAB)), Spy(), sid, out)
    assert sorted(VOCAB[i] for i in out) == [b'"']
    # the root's children (one per first byte) are all tried once; below them only the '"' subtree is entered
    first_bytes = {d[0] for d in VOCAB}
    assert len(visited) <= len(first_bytes) + 8, f"the walk read {len(visited)} bytes: it does not prune"


class CountingDict(dict):
    """A trie node's children that note when the walk looks at them (the node is entered)."""
    entered: set = set()

    def _note(self):
        CountingDict.entered.add(id(self))

    def items(self):
        self._note()
        return super().items()

    def keys(self):
        self._note()
        return super().keys()

    def values(self):
        self._note()
        return super().values()

    def __iter__(self):
        self._note()
        return super().__iter__()

    def __getitem__(self, k):
        self._note()
        return super().__getitem__(k)

    def get(self, k, default=None):
        self._note()
        return super().get(k, default)


def counting_trie(items):
    root = ([], CountingDict())
    for i, data in items:
        node = root
        for b in data:
            node = node[1].setdefault(b, ([], CountingDict()))
        node[0].append(i)
    return root


@pytest.mark.exercise("walk_trie")
def test_the_walk_enters_only_the_subtrees_it_may():
    """Counting trie nodes entered, not bytes read: a walk that lists the whole vocabulary and checks each token
    with automaton.walk finds the right tokens and reads few bytes through `next`, yet enters every node."""
    a = Automaton(compile_schema(SCHEMA))
    sid = a.walk(a.start, b"{")
    trie = counting_trie(enumerate(VOCAB))
    CountingDict.entered = set()
    out: list[int] = []
    impl.walk_trie(trie, a, sid, out)
    assert sorted(VOCAB[i] for i in out) == [b'"']
    total = 1 + sum(len(d) for d in VOCAB)                 # an upper bound on the trie's nodes
    assert len(CountingDict.entered) <= 4, (
        f"the walk entered {len(CountingDict.entered)} trie nodes (of up to {total}): after '{{' only the '\"' "
        f"subtree may be entered; a walk over the whole vocabulary is what the trie is there to avoid")


# --- auto_schema: tool_choice "auto" as one grammar -------------------------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}


def accepts(schema, value) -> bool:
    from tinyserve.constrained import dumps
    return Automaton(compile_schema(schema)).matches(dumps(value).encode())


@pytest.mark.exercise("auto_schema")
def test_auto_lets_the_model_call_or_answer():
    schema = impl.auto_schema({"get_weather": WEATHER, "get_time": TIME}, True)
    assert accepts(schema, {"response": "It is sunny."}), "a text answer must be possible"
    assert accepts(schema, {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]})
    assert accepts(schema, {"tool_calls": [{"name": "get_time", "arguments": {"zone": "CET"}},
                                           {"name": "get_weather", "arguments": {"city": "Rome"}}]}), \
        "parallel=True: several calls in one answer"
    assert not accepts(schema, {}), "an answer must be a call or a text, not nothing"
    assert not accepts(schema, {"tool_calls": []}), "a call list must hold at least one call"
    assert not accepts(schema, {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
                                "response": "hi"}), "one answer is either a call or a text: never both"


@pytest.mark.exercise("auto_schema")
def test_each_call_is_valid_for_its_own_function():
    schema = impl.auto_schema({"get_weather": WEATHER, "get_time": TIME}, True)
    assert not accepts(schema, {"tool_calls": [{"name": "get_news", "arguments": {}}]}), "only the listed tools"
    assert not accepts(schema, {"tool_calls": [{"name": "get_time", "arguments": {"city": "Paris"}}]}), \
        "get_time's arguments are get_time's schema, not another tool's (a const name per option)"
    assert not accepts(schema, {"tool_calls": [{"name": "get_weather", "arguments": {"city": 3}}]})


@pytest.mark.exercise("auto_schema")
def test_parallel_false_allows_one_call():
    schema = impl.auto_schema({"get_weather": WEATHER}, False)
    one = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert accepts(schema, {"tool_calls": [one]})
    assert not accepts(schema, {"tool_calls": [one, one]}), "parallel_tool_calls=false: at most one call"
