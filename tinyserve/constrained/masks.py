"""From an automaton state to the tokens that may come next: the token mask, cached per state, and jump-forward.

A token is allowed in state s when the automaton can read all of its bytes from s. Checking the 49,152 tokens one by
one would read ~300k bytes per step; walking the vocabulary's trie instead reads each shared prefix once and drops
a whole subtree at its first impossible byte (after '{' only tokens starting with '"' or '}' survive the first
level). Inside a string almost every token is allowed, so the walk would visit everything: there, the plain tokens
(whole characters, no quote, backslash or control character: they leave the string body unchanged) are allowed
in one vector operation and only the other few thousand are walked. The automaton is deterministic over its
(lazily numbered) states, so the mask depends only on the state id and is computed once per state.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .automaton import DEAD, Automaton, Node
from .vocab import TrieNode, Vocabulary


def apply_mask(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:   # [V], [V] bool -> [V]
    """-inf on every token not allowed: exp(-inf) = 0, so every sampler renormalises over the allowed tokens (a
    0 instead would leave them in the running: a logit of 0 beats an allowed -5)."""
    return np.where(allowed, logits, -np.inf).astype(logits.dtype, copy=False)


class GrammarBudgetError(ValueError):
    """One mask would take more work than a step may spend on it (see MAX_MASK_READS): the request is refused."""


# The work one mask may take on the engine thread. A trie walk enters each trie node at most once, and an entered
# node costs a memoised lookup, or on a miss one read per stack of the state (automaton.reads counts those): the
# misses are what a hostile grammar multiplies, so they are what is bounded (docs/structured-output.md, "Bounded
# cost", has the measured cost per read).
MAX_MASK_READS = 20_000


def walk_trie(root: TrieNode, automaton: Automaton, sid: int, out: list[int]) -> None:
    """Append to `out` every token of the trie whose bytes the automaton can read from state `sid`."""
    step = automaton.next
    todo = [(root, sid)]
    while todo:
        (ids, children), s = todo.pop()
        out.extend(ids)
        for b, child in children.items():
            t = step(s, b)
            if t != DEAD:
                todo.append((child, t))


def walk_trie_within(root: TrieNode, automaton: Automaton, sid: int, out: list[int], max_reads: int) -> None:
    """walk_trie under a work budget: GrammarBudgetError once the walk has cost more than `max_reads` uncached
    stack reads (checked every 256 trie nodes entered)."""
    step = automaton.next
    todo = [(root, sid)]
    limit = automaton.reads + max_reads
    entered = 0
    while todo:
        (ids, children), s = todo.pop()
        out.extend(ids)
        for b, child in children.items():
            t = step(s, b)
            if t != DEAD:
                todo.append((child, t))
        entered += 1
        if not entered & 255 and automaton.reads > limit:
            raise GrammarBudgetError(f"grammar budget: one token mask needs more than {max_reads} automaton "
                                     f"reads (the schema is too ambiguous to be served)")


class TokenGrammar:
    """One grammar bound to one vocabulary: its automaton and the masks of the states met so far (shared by every
    request with the same schema). Masks are kept packed (a bit per token) and at most `max_bytes` of them; the
    automaton's own memory is estimated (STATE_BYTES per state) for the GrammarCache's byte budget."""

    STATE_BYTES = 512                               # a state's stack set, its id and its edge dict, roughly

    def __init__(self, root: Node, vocab: Vocabulary, max_bytes: int = 8 << 20, max_reads: int | None = None):
        self.automaton = Automaton(root)
        self.vocab = vocab
        self.masks: dict[int, np.ndarray] = {}      # state id -> [ceil(V / 8)] uint8: the packed [V] bool mask
        self.max_cached = max(1, max_bytes // max(1, (vocab.size + 7) // 8))
        self.max_reads = MAX_MASK_READS if max_reads is None else max_reads
        self.mask_computations = 0                  # how many masks were computed (not served from the cache)
        self.jump_forward = True                    # off: forced text is sampled token by token (to measure it)

    def nbytes(self) -> int:
        """Roughly what this grammar holds in memory: its packed masks and its automaton's states."""
        return len(self.masks) * ((self.vocab.size + 7) // 8) + len(self.automaton.stacks) * self.STATE_BYTES

    def mask(self, sid: int) -> np.ndarray:
        """[V] bool: the tokens allowed in state `sid` (EOS only when the value is complete)."""
        packed = self.masks.get(sid)
        if packed is None:
            m = self.compute_mask(sid)
            if len(self.masks) >= self.max_cached:  # a deeply nesting "any JSON" can meet endless states
                self.masks.pop(next(iter(self.masks)))
            self.masks[sid] = np.packbits(m)
            return m
        return np.unpackbits(packed, count=self.vocab.size).view(bool)

    def compute_mask(self, sid: int, use_plain: bool = True) -> np.ndarray:
        """The mask of one state, uncached. use_plain=False walks the whole trie even inside strings (for
        measuring what the plain-token shortcut saves). GrammarBudgetError if it costs more than max_reads."""
        self.mask_computations += 1
        vocab, a = self.vocab, self.automaton
        m = np.zeros(vocab.size, dtype=bool)
        ids: list[int] = []
        inside, other, room = a.string_split(sid) if use_plain else (DEAD, sid, None)
        if inside != DEAD:
            m |= vocab.plain if room is None else vocab.plain & (vocab.plain_chars <= room)
            walk_trie_within(vocab.inner_trie, a, inside, ids, self.max_reads)
        if other != DEAD:
            walk_trie_within(vocab.trie, a, other, ids, self.max_reads)
        m[ids] = True
        if a.is_complete(sid):
            m[list(vocab.eos_ids)] = True
        return m

    def start(self) -> "ConstraintState":
        return ConstraintState(self, self.automaton.start)


@dataclass(slots=True)
class ConstraintState:
    """One request's place in its grammar (the Engine keeps one per constrained sequence)."""
    grammar: TokenGrammar
    state: int
    eos_seen: bool = False

    def allowed(self) -> np.ndarray:           # [V] bool
        return self.grammar.mask(self.state)

    def apply(self, logits: np.ndarray) -> np.ndarray:   # [V] -> [V]: -inf on every token not allowed
        return apply_mask(logits, self.allowed())

    def advance(self, token: int) -> None:
        """Read one sampled token. Raises ValueError for a token the mask did not allow."""
        if token in self.grammar.vocab.eos_ids:
            if not self.complete:
                raise ValueError(f"EOS before the JSON value is complete")
            self.eos_seen = True
            return
        data = self.grammar.vocab.token_bytes[token] if 0 <= token < self.grammar.vocab.size else None
        nxt = self.grammar.automaton.walk(self.state, data) if data else DEAD
        if nxt == DEAD:
            raise ValueError(f"token {token} ({data!r}) is not allowed by the grammar here")
        self.state = nxt

    @property
    def complete(self) -> bool:                # what was generated is a whole value (it may still go on)
        return self.grammar.automaton.is_complete(self.state)

    @property
    def finished(self) -> bool:                # complete, and not one more byte could follow: stop now
        return self.eos_seen or (self.complete and not self.grammar.automaton.next_bytes(self.state))

    def accept(self, token: int, max_forced: int) -> list[int]:
        """Advance by a sampled token, then jump forward: the tokens of the text the grammar forces next (up to
        `max_forced`) are advanced too. Returns [token, *forced]: the Engine appends them all; the forced ones run
        through the model in the next step as one chunk, like a prompt's, instead of one forward each."""
        self.advance(token)
        jump = self.grammar.jump_forward and not self.finished
        forced = self.forced_tokens()[:max(max_forced, 0)] if jump else []
        for t in forced:
            self.advance(t)
        return [token, *forced]

    def copy(self) -> "ConstraintState":
        return ConstraintState(self.grammar, self.state, self.eos_seen)

    def valid_prefix(self, tokens) -> int:
        """How many of `tokens` the grammar allows in a row from here (a draft is cut there), not going past the
        point where the value is finished."""
        probe = self.copy()
        for n, t in enumerate(tokens):
            if probe.finished or not probe.allowed()[t]:
                return n
            probe.advance(int(t))
        return len(tokens)

    def apply_rows(self, logits: np.ndarray, tokens) -> np.ndarray:
        """[k + 1, V] -> [k + 1, V]: row i masked for the state after tokens[:i] (a draft's verify rows)."""
        probe, out = self.copy(), np.empty_like(logits)
        for i in range(len(logits)):
            out[i] = probe.apply(logits[i])
            if i < len(tokens):
                probe.advance(int(tokens[i]))
        return out

    def forced_tokens(self) -> list[int]:
        """Jump-forward: the tokens of the bytes the grammar forces next (a key, a separator), to be appended
        without sampling. They are the tokenizer's own tokenization of the forced text, less its last token: the
        model picks the token at the boundary itself, since the best one may straddle the forced text and what
        follows (`"` + `name`, `: ` + `"`). Empty when nothing is forced or the tokens do not spell the text."""
        g = self.grammar
        forced = g.automaton.forced(self.state)
        if len(forced) < 2 or g.vocab.encode is None:
            return []
        text = forced.decode("utf-8", errors="ignore")   # drop a cut UTF-8 character at the end
        try:
            ids = g.vocab.encode(text)[:-1]
        except ValueError:
            return []
        sid = self.state
        for t in ids:                          # every token must be an ordinary one the grammar allows
            data = g.vocab.token_bytes[t] if 0 <= t < g.vocab.size else None
            sid = g.automaton.walk(sid, data) if data else DEAD
            if sid == DEAD:
                return []
        return ids
