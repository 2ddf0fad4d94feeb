"""The grammar as a pushdown automaton over bytes, determinised lazily into numbered states.

A compiled grammar is a graph of `Node`s (schema.py builds it). Only three kinds read bytes — `Literal` (one of a
few exact byte strings: `true`, `{`, `", "`, an enum value), `String` (any JSON string, UTF-8 checked byte by byte)
and `Number` — the others (`Array`, `Object`, `AnyObject`, `AnyOf`) only decide which child comes next. A *frame*
is (node, local state); a *stack* is a tuple of frames, the innermost last. Before reading a byte, a stack is
expanded through its epsilon moves ("push this child", "this frame is done, pop it") until its top frame is one
that reads; a stack that pops its last frame means "the value is complete" and is kept as the empty tuple.

Choices (an optional property present or not, `anyOf`, "more digits or is the number over?") make the automaton
nondeterministic, so a state is the *set* of stacks it may be in. States are interned as small integers and their
byte transitions memoised (`Automaton.next`), so the pushdown automaton becomes, lazily, a DFA over the states the
text actually visits: the trie walk of masks.py follows an int -> int table instead of re-expanding stacks.

Whitespace: none, except one space after every `,` and `:` (the layout of Python's json.dumps, which the model has
seen a lot). Free whitespace would let a model pad forever without the grammar ever ending.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

ITEM_SEP, KEY_SEP = b", ", b": "
DEAD = -1                                      # the state id of "no stack survives": that byte is not allowed

Frame = tuple                                  # (node, local state): local is a small hashable value
Stack = tuple                                  # tuple[Frame, ...], innermost last; () = the value is complete


class Node:
    """A grammar symbol. `start()` is a new frame's local state; `moves(local)` lists its epsilon moves:
    ("read",) it reads the next byte itself, ("pop",) it is done, ("push", child, local_after) it hands over to
    `child` and resumes in `local_after` when the child pops. Reading nodes implement `read(local, byte)`."""
    def start(self):
        return 0

    def moves(self, local) -> list[tuple]:
        raise NotImplementedError

    def read(self, local, byte: int):          # -> the new local state, or None: this byte is not allowed here
        return None


@dataclass(eq=False)                           # identity hash: nodes are graph vertices, the graph may be cyclic
class Literal(Node):
    """One of a few exact byte strings. Its proper prefixes are kept in a dict (prefix -> the bytes that may
    follow), so reading a byte costs one lookup however many options an enum has."""
    options: tuple[bytes, ...]                 # the frame's local state is the prefix read so far

    def __post_init__(self):
        self._next: dict[bytes, set] = {}
        for o in self.options:
            for k in range(len(o)):
                self._next.setdefault(o[:k], set()).add(o[k])
        self._whole = frozenset(self.options)

    def start(self):
        return b""

    def moves(self, prefix):
        out = [("read",)] if prefix in self._next else []
        return out + [("pop",)] if prefix in self._whole else out

    def read(self, prefix, byte):
        return prefix + bytes((byte,)) if byte in self._next.get(prefix, ()) else None

    def peek(self, prefix):
        return self._next.get(prefix, ())


def _utf8_lead(byte: int):
    """The local state after the first byte of a multi-byte UTF-8 character: (continuation bytes still due,
    the allowed range of the next one). The narrowed ranges exclude overlong forms, surrogates and > U+10FFFF."""
    if 0xC2 <= byte <= 0xDF:
        return ("u", 1, 0x80, 0xBF)
    if byte == 0xE0:
        return ("u", 2, 0xA0, 0xBF)
    if 0xE1 <= byte <= 0xEF:
        return ("u", 2, 0x80, 0x9F if byte == 0xED else 0xBF)
    if byte == 0xF0:
        return ("u", 3, 0x90, 0xBF)
    if 0xF1 <= byte <= 0xF3:
        return ("u", 3, 0x80, 0xBF)
    if byte == 0xF4:
        return ("u", 3, 0x80, 0x8F)
    return None                                # 0x80-0xC1, 0xF5-0xFF never start a character


_ESCAPES = frozenset(b'"\\bfnrt')      # JSON's, less the pointless \/ (llguidance refuses it too)
_HEX = frozenset(b"0123456789abcdefABCDEF")
BODY = "body"                                  # String's local state between characters (masks.py's fast path)


def in_body(local) -> bool:
    """A String's local state is between two characters (counted or not)."""
    return local == BODY or (isinstance(local, tuple) and local[0] == "n" and local[1] == BODY)


@dataclass(eq=False)
class String(Node):
    """A JSON string: '"', then characters, then '"'. Three rules stricter than JSON's, as llguidance's: no raw DEL
    (0x7F) beside the control characters JSON forbids, no `\\/` escape, and a \\u escape of a UTF-16 surrogate only
    as a pair (high \\uD800-\\uDBFF then low \\uDC00-\\uDFFF): a lone half is not a character.

    With `min_len`/`max_len` (JSON Schema's minLength/maxLength, in characters: code points, an escape or a
    surrogate pair being one) the local state carries the count: ("n", inner local, characters so far). A character
    may only begin while the count is below max_len, so no allowed byte leads to a dead end."""
    min_len: int = 0
    max_len: int | None = None

    @property
    def counted(self) -> bool:
        return self.min_len > 0 or self.max_len is not None

    def start(self):
        return ("n", "open", 0) if self.counted else "open"

    def moves(self, local):
        inner = local[1] if isinstance(local, tuple) and local[0] == "n" else local
        return [("pop",)] if inner == "end" else [("read",)]

    def read(self, local, b):
        if not self.counted:
            return self._read(local, b)
        _, inner, n = local
        if inner == BODY:
            if b == 0x22:
                return ("n", "end", n) if n >= self.min_len else None
            if self.max_len is not None and n >= self.max_len:
                return None                    # no room for one more character
        new = self._read(inner, b)
        if new is None:
            return None
        done = new == BODY and inner != "open" # a character (or an escape, or a surrogate pair) just completed
        return ("n", new, n + 1 if done else n)

    def room(self, local) -> int | None:
        """How many more characters fit (None: no bound)."""
        return None if self.max_len is None else self.max_len - local[2]

    def _read(self, local, b):
        if local == "open":
            return BODY if b == 0x22 else None
        if local == BODY:
            if b == 0x22:
                return "end"
            if b == 0x5C:
                return "esc"
            if b < 0x20 or b == 0x7F:
                return None
            return BODY if b < 0x80 else _utf8_lead(b)
        if local == "esc":
            return BODY if b in _ESCAPES else (("hex", 4, "") if b == 0x75 else None)
        if local[0] == "hex":
            return _hex_digit(local[1], local[2], b)
        if local == "pair":                    # after a high surrogate's escape: the low half's must follow
            return "pair-u" if b == 0x5C else None
        if local == "pair-u":
            return ("hex", 4, "low") if b == 0x75 else None
        _, due, lo, hi = local                 # inside a multi-byte UTF-8 character
        if not lo <= b <= hi:
            return None
        return BODY if due == 1 else ("u", due - 1, 0x80, 0xBF)


def _hex_digit(due: int, kind: str, b: int):
    """One hex digit of a \\uXXXX escape, `due` digits still to come. `kind` tracks UTF-16 surrogates: "D?" (the
    escape began with D: a surrogate if the next digit is 8-F), "high" (D800-DBFF: a low half must follow), "low"
    (the escape after a high half: it must be DC00-DFFF), "" (an ordinary character)."""
    if b not in _HEX:
        return None
    first = due == 4
    if kind == "low" and ((first and b not in b"dD") or (due == 3 and b not in b"cdefCDEF")):
        return None
    if kind == "D?":                           # the second digit decides: 8-B a high half, C-F a lone low half
        if b in b"cdefCDEF":
            return None
        kind = "high" if b in b"89abAB" else ""
    elif first and kind == "" and b in b"dD":
        kind = "D?"
    if due > 1:
        return ("hex", due - 1, kind)
    return "pair" if kind == "high" else BODY


_DIGIT = frozenset(b"0123456789")


# A number's digits are bounded, as whitespace is: unbounded, a greedy model can write "1111..." until max_tokens cuts
# the value off, invalid. 15 digits hold every integer a float64 stores exactly (< 2^53) and its precision.
MAX_INT_DIGITS, MAX_FRAC_DIGITS, MAX_EXP_DIGITS = 15, 15, 3


@dataclass(eq=False)
class Number(Node):
    """A JSON number, -?(0|[1-9][0-9]{0,14})(.[0-9]{1,15})?([eE][+-]?[0-9]{1,3})?; `integer`: without fraction and
    exponent. Local states: "start", "minus", "zero", "frac0", "exp0", "exp1", or (part, digits so far)."""
    integer: bool = False

    def start(self):
        return "start"

    def moves(self, local):
        done = local == "zero" or isinstance(local, tuple)
        return [("read",), ("pop",)] if done else [("read",)]

    def read(self, s, b):
        digit = b in _DIGIT
        if s in ("start", "minus"):
            if b == 0x2D and s == "start":
                return "minus"
            return ("zero" if b == 0x30 else ("int", 1)) if digit else None
        if digit:                              # one more digit of the part we are in, within its bound
            if s in ("frac0", "exp0", "exp1"):
                return ("frac" if s == "frac0" else "exp", 1)
            if s == "zero":
                return None                    # no leading zeros
            part, n = s
            limit = {"int": MAX_INT_DIGITS, "frac": MAX_FRAC_DIGITS, "exp": MAX_EXP_DIGITS}[part]
            return (part, n + 1) if n < limit else None
        if self.integer:
            return None
        if b == 0x2E and (s == "zero" or s[0] == "int"):
            return "frac0"
        if b in (0x65, 0x45) and (s == "zero" or (isinstance(s, tuple) and s[0] in ("int", "frac"))):
            return "exp0"
        if b in (0x2B, 0x2D) and s == "exp0":
            return "exp1"
        return None


@dataclass(eq=False)
class AnyOf(Node):
    options: tuple[Node, ...] = ()             # filled in after construction for the recursive "any value"

    def moves(self, local):
        return [("pop",)] if local == 1 else [("push", o, 1) for o in self.options]


@dataclass(eq=False)
class Array(Node):
    """'[' item (', ' item)* ']' with min_items <= count <= max_items (None: unbounded)."""
    item: Node | None = None
    min_items: int = 0
    max_items: int | None = None

    def moves(self, n):                        # local: -1 before '[', n >= 0 items so far, "end" after ']'
        if n == "end":
            return [("pop",)]
        if n == -1:
            return [("push", _OPEN_ARR, 0)]
        out = []
        if n >= self.min_items:
            out.append(("push", _CLOSE_ARR, "end"))
        if self.max_items is None or n < self.max_items:
            out.append(("push", self.item if n == 0 else self._rest, n + 1))
        return out

    def start(self):
        return -1

    def __post_init__(self):
        self._rest = _SepThen(self.item)       # one node for "', ' item", so the states it makes stay few


@dataclass(eq=False)
class _SepThen(Node):
    """', ' then `node`: an array's second and later items."""
    node: Node

    def moves(self, local):
        return [("push", _ITEM_SEP, 1)] if local == 0 else \
            [("push", self.node, 2)] if local == 1 else [("pop",)]


@dataclass(eq=False)
class Property:
    key: str
    value: Node
    required: bool


@dataclass(eq=False)
class Object(Node):
    """'{' then the properties in the schema's order, each optional one present or not, then '}'. Keys come in
    schema order (a fixed order keeps the automaton small; JSON objects are unordered, so nothing valid is lost
    but the order). No other keys (additionalProperties: false)."""
    props: tuple[Property, ...] = ()
    _keys: dict = field(default_factory=dict)

    def start(self):
        return "open"

    def moves(self, local):
        if local == "open":
            return [("push", _OPEN_OBJ, (0, False))]
        if local == "end":
            return [("pop",)]
        if local[0] == "value":                # the key is out: its value follows
            return [("push", self.props[local[1]].value, (local[1] + 1, True))]
        i, emitted = local                     # next candidate property, whether one was written already
        out = []
        for j in range(i, len(self.props)):    # any of the next properties up to the first required one
            out.append(("push", self._key(j, emitted), ("value", j)))
            if self.props[j].required:
                return out
        return out + [("push", _CLOSE_OBJ, "end")]

    def _key(self, j: int, emitted: bool) -> Literal:
        """The literal before property j's value: ', ' if one came before, then '"key": '."""
        lit = self._keys.get((j, emitted))
        if lit is None:
            from json import dumps
            key = dumps(self.props[j].key, ensure_ascii=False).encode() + KEY_SEP
            lit = self._keys[(j, emitted)] = Literal(((ITEM_SEP if emitted else b"") + key,))
        return lit


@dataclass(eq=False)
class AnyObject(Node):
    """Any JSON object: '{' ( '}' | string ': ' value (', ' string ': ' value)* '}' )."""
    value: Node | None = None                  # the "any value" node (set after construction: it is recursive)

    def start(self):
        return "open"

    def moves(self, s):
        return {"open": [("push", _OPEN_OBJ, "first")],
                "first": [("push", _CLOSE_OBJ, "end"), ("push", _KEY, "colon")],
                "colon": [("push", _KEY_SEP, "value")],
                "value": [("push", self.value, "after")],
                "after": [("push", _CLOSE_OBJ, "end"), ("push", _ITEM_SEP, "key")],
                "key": [("push", _KEY, "colon")],
                "end": [("pop",)]}[s]


_OPEN_ARR, _CLOSE_ARR = Literal((b"[",)), Literal((b"]",))
_OPEN_OBJ, _CLOSE_OBJ = Literal((b"{",)), Literal((b"}",))
_ITEM_SEP, _KEY_SEP, _KEY = Literal((ITEM_SEP,)), Literal((KEY_SEP,)), String()


def any_value() -> Node:
    """Any JSON value (objects and arrays nest to any depth)."""
    value = AnyOf()
    value.options = (_KEY, Number(), Literal((b"true", b"false", b"null")), AnyObject(value), Array(value))
    return value


def _closure(stack: Stack, out: set, depth: int = 0) -> None:
    """Follow epsilon moves from `stack` until every branch has a reading frame on top (or is complete: ())."""
    if depth > 10_000:
        raise ValueError("the grammar loops without reading a byte")
    if not stack:
        out.add(())
        return
    node, local = stack[-1]
    for move in node.moves(local):
        if move[0] == "read":
            out.add(stack)
        elif move[0] == "pop":
            _closure(stack[:-1], out, depth + 1)
        else:
            _, child, after = move
            _closure(stack[:-1] + ((node, after), (child, child.start())), out, depth + 1)


@dataclass
class Automaton:
    """The lazily determinised automaton of one grammar: state ids, their stack sets, memoised transitions."""
    root: Node
    stacks: list[frozenset] = field(default_factory=list)     # state id -> its set of stacks
    ids: dict[frozenset, int] = field(default_factory=dict)   # the inverse
    edges: list[dict[int, int]] = field(default_factory=list)  # state id -> {byte: next state id}
    reads: int = 0                             # stack reads done so far (uncached transitions x their stacks)

    def __post_init__(self):
        start: set = set()
        _closure(((self.root, self.root.start()),), start)
        self.start = self.intern(frozenset(start))

    def intern(self, stacks: frozenset) -> int:
        if not stacks:
            return DEAD
        sid = self.ids.get(stacks)
        if sid is None:
            sid = self.ids[stacks] = len(self.stacks)
            self.stacks.append(stacks)
            self.edges.append({})
        return sid

    def next(self, sid: int, byte: int) -> int:
        """The state after reading `byte` in state `sid` (DEAD if no stack can read it)."""
        edges = self.edges[sid]
        nxt = edges.get(byte)
        if nxt is None:
            out: set = set()
            self.reads += len(self.stacks[sid])  # the work counter the mask budget reads (masks.py)
            for stack in self.stacks[sid]:
                if stack:
                    node, local = stack[-1]
                    new = node.read(local, byte)
                    if new is not None:
                        _closure(stack[:-1] + ((node, new),), out)
            nxt = edges[byte] = self.intern(frozenset(out))
        return nxt

    def walk(self, sid: int, data: bytes) -> int:
        for b in data:
            if sid == DEAD:
                break
            sid = self.next(sid, b)
        return sid

    def is_complete(self, sid: int) -> bool:
        """The text so far is a whole value (it may still go on, e.g. a top-level number)."""
        return sid != DEAD and () in self.stacks[sid]

    def next_bytes(self, sid: int) -> list[int]:
        """The bytes that may come next. Where every stack's top is a Literal, only the bytes those can read are
        tried (forced() walks long keys byte by byte: trying all 256 at each would cost more than the mask)."""
        stacks = self.stacks[sid]
        if stacks and all(st and isinstance(st[-1][0], Literal) for st in stacks):
            candidates = sorted(set().union(*(st[-1][0].peek(st[-1][1]) for st in stacks)))
        else:
            candidates = range(256)
        return [b for b in candidates if self.next(sid, b) != DEAD]

    def forced(self, sid: int, limit: int = 256) -> bytes:
        """The bytes that must come next whatever the model does (a key, a separator, the rest of `true`):
        the run of states with exactly one way on and not complete."""
        out = bytearray()
        while len(out) < limit and not self.is_complete(sid):
            nxt = self.next_bytes(sid)
            if len(nxt) != 1:
                break
            out.append(nxt[0])
            sid = self.next(sid, nxt[0])
        return bytes(out)

    def string_split(self, sid: int) -> tuple[int, int, int | None]:
        """(the state of just the stacks sitting in a string's body, the state of the others, how many characters
        the first may still take: None for no bound): masks.py allows every "plain" token that fits in the first at
        once (they leave a string body as it was, but for its length) and walks the trie only for the rest."""
        inside, other = set(), set()
        for stack in self.stacks[sid]:
            room: int | None = 0                   # the most characters a plain token may add (None: any)
        for stack in self.stacks[sid]:
            body = stack and isinstance(stack[-1][0], String) and in_body(stack[-1][1])
            (inside if body else other).add(stack)
            if body:
                r = stack[-1][0].room(stack[-1][1]) if stack[-1][0].counted else None
                room = None if room is None or r is None else max(room, r)
        return self.intern(frozenset(inside)), self.intern(frozenset(other)), room

    def matches(self, data: bytes) -> bool:
        return self.is_complete(self.walk(self.start, data))

    def describe(self, sid: int) -> Iterator[str]:
        for stack in self.stacks[sid]:
            yield " > ".join(f"{type(n).__name__}:{loc!r}" for n, loc in stack) or "(complete)"


# --- numbers with bounds, strings with a pattern (JSON Schema's minimum/maximum, pattern and format) --------------

@dataclass(eq=False)
class BoundedNumber(Node):
    """A JSON number within [lo, hi] (either may be None), written without an exponent:
    -?(0|[1-9][0-9]{0,14})(.[0-9]{1,15})?, or for `integer` without the fraction. The local state is the text so
    far; a byte is allowed only if some number within the bounds begins with the text it makes (so the walk never
    enters a dead end), and the number may end only once its value is within them. `lo_open`/`hi_open`: the bound
    itself is excluded (exclusiveMinimum/exclusiveMaximum). Bounds are exact (rational arithmetic), not floats."""
    lo: object = None                          # fractions.Fraction | None
    hi: object = None
    integer: bool = False
    lo_open: bool = False
    hi_open: bool = False

    def start(self):
        return b""

    def moves(self, text):
        return [("read",), ("pop",)] if self._value(text) is not None and self._fits(self._value(text)) \
            else [("read",)]

    def read(self, text, b):
        t = text + bytes((b,))
        return t if _number_prefix(t, self.integer) and self._reachable(t) else None

    @staticmethod
    def _value(text: bytes):
        from fractions import Fraction
        if not text or text in (b"-",) or text.endswith(b"."):
            return None
        return Fraction(text.decode())

    def _fits(self, v) -> bool:
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        if self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)):
            return False
        return True

    def _reachable(self, text: bytes) -> bool:
        """Does some number within the bounds start with `text`? Its completions form a few intervals of values."""
        from fractions import Fraction
        neg = text.startswith(b"-")
        body = text[1:] if neg else text
        # "-0" (a zero written with a minus) only where negative numbers are allowed at all, as llguidance: below
        # that, a minus needs a magnitude of at least one unit in its last place
        tiny = Fraction(1) if self.integer else Fraction(1, 10 ** MAX_FRAC_DIGITS)
        negatives = self.lo is None or self.lo < 0
        if not text:                                      # either sign, any magnitude
            return self._meets(Fraction(0), None) or self._meets(None, -tiny)
        if not body:
            intervals = [(Fraction(0), None)]             # any magnitude
        else:
            whole, dot, frac = body.partition(b".")
            if dot:
                scale = Fraction(1, 10 ** len(frac))
                base = Fraction(int(whole)) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
                top = base + scale - Fraction(1, 10 ** MAX_FRAC_DIGITS)
                intervals = [(base, max(base, top))]
            else:
                n = int(whole)
                room = 0 if whole == b"0" else MAX_INT_DIGITS - len(whole)
                frac_top = 0 if self.integer else 1 - Fraction(1, 10 ** MAX_FRAC_DIGITS)
                intervals = [(Fraction(n * 10 ** k), (n + 1) * 10 ** k - 1 + frac_top) for k in range(room + 1)]
        for a, z in intervals:
            if neg and a == 0 and not negatives:
                a = tiny
                if z is not None and z < a:
                    continue
            lo, hi = (a, z) if not neg else ((-z if z is not None else None), -a)
            if self._meets(lo, hi):
                return True
        return False

    def _meets(self, a, z) -> bool:
        """[a, z] (None: unbounded on that side) meets the allowed range, counting only values the grammar can
        write (an integer's completions are integers)."""
        import math
        lo = a if self.lo is None else (self.lo if a is None else max(a, self.lo))
        hi = z if self.hi is None else (self.hi if z is None else min(z, self.hi))
        lo_open = self.lo_open and lo is not None and lo == self.lo
        hi_open = self.hi_open and hi is not None and hi == self.hi
        if self.integer:
            first = None if lo is None else math.ceil(lo) + (1 if lo_open and math.ceil(lo) == lo else 0)
            last = None if hi is None else math.floor(hi) - (1 if hi_open and math.floor(hi) == hi else 0)
            return first is None or last is None or first <= last
        if lo is None or hi is None:
            return True
        return lo < hi or (lo == hi and not lo_open and not hi_open)


def _number_prefix(t: bytes, integer: bool) -> bool:
    """Is `t` a prefix of -?(0|[1-9][0-9]{0,14})(.[0-9]{1,15})? (without the fraction for integers)?"""
    body = t[1:] if t.startswith(b"-") else t
    if b"-" in body or not body:
        return bool(t == b"-" or not t)
    whole, dot, frac = body.partition(b".")
    if not whole.isdigit() or (len(whole) > 1 and whole[0:1] == b"0") or len(whole) > MAX_INT_DIGITS:
        return False
    if dot:
        return not integer and (not frac or frac.isdigit()) and len(frac) <= MAX_FRAC_DIGITS
    return True


# code point ranges a UTF-8 lead byte can begin (the same narrowing as _utf8_lead)
def _lead_range(b: int):
    if 0xC2 <= b <= 0xDF:
        return (b & 0x1F), 1
    if 0xE0 <= b <= 0xEF:
        return (b & 0x0F), 2
    if 0xF0 <= b <= 0xF4:
        return (b & 0x07), 3
    return None


@dataclass(eq=False)
class PatternString(Node):
    """A JSON string whose decoded value matches a regular expression (regex.py's NFA), with optional length
    bounds. Each character is decoded as its bytes arrive (raw UTF-8 or a JSON escape) and moves the NFA; a byte
    is allowed only if some character it may begin can still move the NFA (no dead ends). As llguidance does, a
    character is written raw whenever JSON allows it: an escape only for '"', '\\' and the control characters
    (\\uXXXX only for those without a short escape). Local states:
    "open", ("b", nfa states, n), ("esc", S, n), ("hex", S, n, digits so far, value, high surrogate or None),
    ("pair", S, n, high), ("pair-u", S, n, high), ("u", S, n, continuation bytes due, code point so far, lo, hi),
    "end"."""
    nfa: object = None                         # regex.NFA
    min_len: int = 0
    max_len: int | None = None

    def start(self):
        return "open"

    def moves(self, local):
        return [("pop",)] if local == "end" else [("read",)]

    def _may(self, states, lo: int, hi: int, n: int) -> bool:
        """Could a character in [lo, hi] come next (the NFA moves on it, and the length allows one more)?"""
        if self.max_len is not None and n >= self.max_len:
            return False
        nfa = self.nfa
        for s in states:
            for ranges, t in nfa.moves[s]:
                if t in nfa.live and any(a <= hi and lo <= z for a, z in ranges):
                    return True
        return False

    def _char(self, states, n: int, c: int):
        if self.max_len is not None and n >= self.max_len:
            return None
        nxt = self.nfa.step(states, c)
        counted = self.min_len > 0 or self.max_len is not None
        return ("b", nxt, n + 1 if counted else 0) if nxt else None   # uncounted: states repeat, masks are shared

    def read(self, local, b):
        if local == "open":
            return ("b", self.nfa.initial(), 0) if b == 0x22 else None
        kind, states, n = local[0], local[1], local[2]
        if kind == "b":
            if b == 0x22:
                return "end" if self.nfa.accept in states and n >= self.min_len else None
            if b == 0x5C:                      # an escape, for a character that cannot be written raw only
                ok = any(self._may(states, lo, hi, n) for lo, hi in ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)))
                return ("esc", states, n) if ok else None
            if b < 0x20 or b == 0x7F:
                return None
            if b < 0x80:
                return self._char(states, n, b)
            lead = _lead_range(b)
            if lead is None:
                return None
            bits, due = lead
            low, high = _UTF8_FIRST_CONT[b]
            if not self._may(states, (bits << 6 * due) | ((low & 0x3F) << 6 * (due - 1)),
                             (bits << 6 * due) | ((high & 0x3F) << 6 * (due - 1)) | ((1 << 6 * (due - 1)) - 1), n):
                return None
            return ("u", states, n, due, bits, low, high)
        if kind == "u":
            _, _, _, due, cp, low, high = local
            if not low <= b <= high:
                return None
            cp = (cp << 6) | (b & 0x3F)
            if due == 1:
                return self._char(states, n, cp)
            span = 6 * (due - 1)
            if not self._may(states, cp << span, (cp << span) | ((1 << span) - 1), n):
                return None
            return ("u", states, n, due - 1, cp, 0x80, 0xBF)
        if kind == "esc":
            simple = {0x22: 0x22, 0x5C: 0x5C, 0x62: 8, 0x66: 12, 0x6E: 10, 0x72: 13, 0x74: 9}
            if b in simple:
                return self._char(states, n, simple[b])
            if b == 0x75:
                return ("hex", states, n, 0, 0, None)
            return None
        if kind in ("pair", "pair-u"):
            want = 0x5C if kind == "pair" else 0x75
            if b != want:
                return None
            return ("pair-u", states, n, local[3]) if kind == "pair" else ("hex", states, n, 0, 0, local[3])
        # a \uXXXX escape's hex digits: only for a control character (U+0000-U+001F), the one kind that has no
        # raw form and no short escape but for \b \f \n \r \t
        _, _, _, got, value, _ = local
        if b not in _HEX:
            return None
        value, got = value * 16 + int(chr(b), 16), got + 1
        span = 4 * (4 - got)
        lo, hi = value << span, min((value << span) | ((1 << span) - 1), 0x1F)
        if lo > hi:
            return None
        if got == 4:
            return self._char(states, n, value)
        return ("hex", states, n, got, value, None) if self._may(states, lo, hi, n) else None


def _minus_low_surrogates(lo: int, hi: int):
    """[lo, hi] less the low surrogates; a high surrogate stands for the supplementary planes it may begin."""
    out = []
    for a, z in ((lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi)):
        if a <= z:
            out.append((a, z))
    if lo <= 0xDBFF and hi >= 0xD800:
        a, z = max(lo, 0xD800), min(hi, 0xDBFF)
        out.append((0x10000 + ((a - 0xD800) << 10), 0x10000 + ((z - 0xD800) << 10) + 0x3FF))
    return out


# the allowed range of the first continuation byte after each lead byte (as _utf8_lead narrows it)
_UTF8_FIRST_CONT = {b: (lead[2], lead[3]) for b in range(0xC2, 0xF5) if (lead := _utf8_lead(b)) is not None}
