"""A regular-expression subset -> an NFA over characters, for JSON Schema's `pattern` and `format`.

The automaton of automaton.py reads bytes; a `pattern` speaks of the *characters* of a string's decoded value.
`PatternString` (automaton.py) bridges them: it decodes each character of the JSON string as its bytes arrive (a
UTF-8 sequence, or an escape such as \\n or \\u00e9) and moves this NFA by the decoded character, so a pattern sits
in the same pushdown automaton as everything else and the token masks come out of the same trie walk.

Supported: literals, `.`, classes `[a-z_]` / `[^...]`, the escapes \\d \\w \\s (and \\D \\W \\S), \\t \\n \\r \\f \\v
\\uXXXX and escaped punctuation, groups `( )` and `(?: )`, alternation `|`, the quantifiers `* + ? {m} {m,} {m,n}`,
and the anchors `^` at the start and `$` at the end. JSON Schema patterns are not anchored (`"a"` matches any string
containing an a), so an unanchored side gets "any characters" there. Refused with a ValueError naming it: back
references, look-around, word boundaries, lazy or possessive quantifiers, named groups, anchors elsewhere, and
patterns whose NFA would exceed MAX_NFA_STATES (a `{m,n}` copies its operand n times).
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_CODEPOINT = 0x10FFFF
MAX_NFA_STATES = 2000          # a compile budget: `(a{100}){100}` would make 10,000 states
MAX_REPEAT = 1000
MAX_GROUP_DEPTH = 50           # the parser recurses once per group: bounded far below Python's recursion limit
MAX_STEPS_CACHED = 65536

Ranges = tuple                 # ((lo, hi), ...) inclusive code point ranges, sorted and disjoint


def _norm(ranges) -> Ranges:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _negate(ranges: Ranges) -> Ranges:
    out, at = [], 0
    for lo, hi in ranges:
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= MAX_CODEPOINT:
        out.append((at, MAX_CODEPOINT))
    return tuple(out)


DIGIT = ((0x30, 0x39),)
WORD = _norm([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = _norm([(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
               (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)])
ANY = ((0, MAX_CODEPOINT),)
DOT = _negate(_norm([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]))    # ECMAScript: not a line terminator
CLASS_ESCAPES = {"d": DIGIT, "D": _negate(DIGIT), "w": WORD, "W": _negate(WORD), "s": SPACE, "S": _negate(SPACE)}
CHAR_ESCAPES = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "0": 0}


@dataclass(slots=True)
class NFA:
    """States 0..n-1; `moves[s]`: [(ranges, target)], `eps[s]`: [target]; one start, one accepting state."""
    moves: list[list] = field(default_factory=list)
    eps: list[list[int]] = field(default_factory=list)
    start: int = 0
    accept: int = 0
    steps: dict = field(default_factory=dict)  # (states, char) -> states

    def new(self) -> int:
        if len(self.moves) >= MAX_NFA_STATES:
            raise ValueError(f"the pattern needs more than {MAX_NFA_STATES} automaton states (a large {{m,n}}?)")
        self.moves.append([])
        self.eps.append([])
        return len(self.moves) - 1

    def closure(self, states) -> frozenset:
        seen, todo = set(states), list(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)

    def step(self, states: frozenset, char: int) -> frozenset:
        """The states after reading `char` (a code point), only those from which the accepting state is reachable.
        Memoised (the subset construction, done lazily), up to MAX_STEPS_CACHED entries."""
        key = (states, char)
        nxt = self.steps.get(key)
        if nxt is None:
            out = [t for s in states for ranges, t in self.moves[s] if _contains(ranges, char)]
            nxt = frozenset(s for s in self.closure(out) if s in self.live)
            if len(self.steps) >= MAX_STEPS_CACHED:
                self.steps.clear()
            self.steps[key] = nxt
        return nxt

    def initial(self) -> frozenset:
        return frozenset(s for s in self.closure([self.start]) if s in self.live)

    def finish(self) -> "NFA":
        """Compute `live`: the states that can still reach the accepting one (a walk never enters a dead end)."""
        back: list[list[int]] = [[] for _ in self.moves]
        for s in range(len(self.moves)):
            for _, t in self.moves[s]:
                back[t].append(s)
            for t in self.eps[s]:
                back[t].append(s)
        live, todo = {self.accept}, [self.accept]
        while todo:
            for s in back[todo.pop()]:
                if s not in live:
                    live.add(s)
                    todo.append(s)
        self.live = frozenset(live)
        if self.start not in live:
            raise ValueError("the pattern matches no string")
        return self

    live: frozenset = frozenset()


def _contains(ranges: Ranges, c: int) -> bool:
    for lo, hi in ranges:
        if c < lo:
            return False
        if c <= hi:
            return True
    return False


# --- the parser: pattern text -> a small tree -> Thompson's construction ------------------------------------------
# tree: ("set", ranges) | ("cat", [tree]) | ("alt", [tree]) | ("rep", tree, lo, hi_or_None)

class _Parser:
    def __init__(self, text: str):
        self.s, self.i, self.depth = text, 0, 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"pattern {self.s!r} at {self.i}: {what}")

    def peek(self) -> str | None:
        return self.s[self.i] if self.i < len(self.s) else None

    def take(self) -> str:
        c = self.s[self.i]
        self.i += 1
        return c

    def parse(self):
        tree = self.alt()
        if self.i != len(self.s):
            raise self.error(f"unexpected {self.peek()!r}")
        return tree

    def alt(self):
        options = [self.cat()]
        while self.peek() == "|":
            self.take()
            options.append(self.cat())
        return options[0] if len(options) == 1 else ("alt", options)

    def cat(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.repeat(self.atom()))
        return ("cat", items)

    def repeat(self, atom):
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.take()
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and self._counted():
                lo, hi = self._counted(consume=True)
            else:
                return atom
            if self.peek() in ("?", "+"):
                raise self.error("lazy or possessive quantifiers are not supported (they change nothing here: drop "
                                 "the extra ? or +)")
            if (hi is not None and hi > MAX_REPEAT) or lo > MAX_REPEAT:
                raise self.error(f"a repetition count above {MAX_REPEAT}")
            atom = ("rep", atom, lo, hi)

    def _counted(self, consume: bool = False):
        """{m}, {m,}, {m,n} at self.i, or None (then '{' is a literal, as in ECMAScript's annex B)."""
        j = self.s.find("}", self.i)
        if j < 0:
            return None
        body = self.s[self.i + 1:j]
        lo, comma, hi = body.partition(",")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        if consume:
            self.i = j + 1
        lo_n, hi_n = int(lo), (int(hi) if hi else (None if comma else int(lo)))
        if hi_n is not None and hi_n < lo_n:
            raise self.error(f"{{{body}}}: the maximum is below the minimum")
        return lo_n, hi_n

    def atom(self):
        c = self.take()
        if c == "(":
            self.depth += 1
            if self.depth > MAX_GROUP_DEPTH:
                raise self.error(f"groups nested deeper than {MAX_GROUP_DEPTH}")
            if self.peek() == "?":
                if self.s.startswith("?:", self.i):
                    self.i += 2
                else:
                    raise self.error("look-around and named groups are not supported")
            tree = self.alt()
            if self.peek() != ")":
                raise self.error("a '(' without its ')'")
            self.take()
            self.depth -= 1
            return tree
        if c == "[":
            return ("set", self.klass())
        if c == ".":
            return ("set", DOT)
        if c == "\\":
            return ("set", self.escape(in_class=False))
        if c in "^$":
            raise self.error(f"{c!r} is supported only at the very start (^) or end ($) of the pattern")
        if c in "*+?":
            raise self.error(f"nothing to repeat before {c!r}")
        if c in ")":
            raise self.error("a ')' without its '('")
        return ("set", ((ord(c), ord(c)),))

    def escape(self, in_class: bool) -> Ranges:
        if self.peek() is None:
            raise self.error("a pattern cannot end with a backslash")
        c = self.take()
        if c in CLASS_ESCAPES:
            return CLASS_ESCAPES[c]
        if c in CHAR_ESCAPES:
            return ((CHAR_ESCAPES[c],) * 2,)
        if c == "u":
            digits = self.s[self.i:self.i + 4]
            if len(digits) != 4 or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error("\\u needs four hex digits")
            self.i += 4
            return ((int(digits, 16),) * 2,)
        if c == "b" and in_class:
            return ((8, 8),)
        if c.isalnum():
            raise self.error(f"the escape \\{c} is not supported (back references, word boundaries, \\p{{...}}, "
                             f"\\x.. are outside the subset)")
        return ((ord(c), ord(c)),)

    def klass(self) -> Ranges:
        negate = self.peek() == "^"
        if negate:
            self.take()
        ranges, first = [], True
        while True:
            if self.peek() is None:
                raise self.error("a '[' without its ']'")
            c = self.take()
            if c == "]" and not first:
                break
            first = False
            if c == "\\":
                part = self.escape(in_class=True)
            else:
                part = ((ord(c), ord(c)),)
            if self.peek() == "-" and self.i + 1 < len(self.s) and self.s[self.i + 1] != "]" and len(part) == 1 \
                    and part[0][0] == part[0][1]:
                self.take()
                d = self.take()
                end = self.escape(in_class=True) if d == "\\" else ((ord(d), ord(d)),)
                if len(end) != 1 or end[0][0] != end[0][1] or end[0][0] < part[0][0]:
                    raise self.error("a bad range in a character class")
                part = ((part[0][0], end[0][0]),)
            ranges.extend(part)
        ranges = _norm(ranges)
        return _negate(ranges) if negate else ranges


def _build(nfa: NFA, tree, start: int, end: int) -> None:
    kind = tree[0]
    if kind == "set":
        nfa.moves[start].append((tree[1], end))
    elif kind == "cat":
        at = start
        for item in tree[1]:
            nxt = nfa.new()
            _build(nfa, item, at, nxt)
            at = nxt
        nfa.eps[at].append(end)
    elif kind == "alt":
        for option in tree[1]:
            _build(nfa, option, start, end)
    else:
        _, item, lo, hi = tree
        at = start
        for _ in range(lo):
            nxt = nfa.new()
            _build(nfa, item, at, nxt)
            at = nxt
        if hi is None:                       # a loop: item* from `at`
            loop = nfa.new()
            nfa.eps[at].append(loop)
            back = nfa.new()
            _build(nfa, item, loop, back)
            nfa.eps[back].append(loop)
            nfa.eps[loop].append(end)
        else:
            for _ in range(hi - lo):         # up to hi - lo optional copies
                nfa.eps[at].append(end)
                nxt = nfa.new()
                _build(nfa, item, at, nxt)
                at = nxt
            nfa.eps[at].append(end)


def compile_regex(pattern: str) -> NFA:
    """The NFA of `pattern` with JSON Schema's semantics (a match anywhere in the string unless anchored)."""
    if not isinstance(pattern, str):
        raise ValueError(f"a pattern must be a string, got {pattern!r}")
    body = pattern
    head = body.startswith("^")
    if head:
        body = body[1:]
    tail = body.endswith("$") and not body.endswith("\\$")
    if tail:
        body = body[:-1]
    tree = _Parser(body).parse()
    if not head:
        tree = ("cat", [("rep", ("set", ANY), 0, None), tree])
    if not tail:
        tree = ("cat", [tree, ("rep", ("set", ANY), 0, None)])
    nfa = NFA()
    nfa.start, nfa.accept = nfa.new(), nfa.new()
    _build(nfa, tree, nfa.start, nfa.accept)
    return nfa.finish()


def full_match(nfa: NFA, text: str) -> bool:
    states = nfa.initial()
    for ch in text:
        states = nfa.step(states, ord(ch))
        if not states:
            return False
    return nfa.accept in states


# The formats, as regular languages (RFC 3339 dates and times, RFC 4122 UUIDs, a dot-atom e-mail address).
_DATE = (r"[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|"
         r"02-(?:0[1-9]|1[0-9]|2[0-9]))")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_ATOM = r"[a-zA-Z0-9!#$%&'*+\-/=?\^_`{|}~]+"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_OCTET = r"(?:[0-9]|[1-9][0-9]|1[0-9]{2}|2[0-4][0-9]|25[0-5])"
FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}[tT]{_TIME}$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "email": rf"^{_ATOM}(?:\.{_ATOM})*@(?:{_LABEL}(?:\.{_LABEL})*|\[(?:{_OCTET}\.){{3}}{_OCTET}\])$",
}
