"""Structured output: decoding constrained by a grammar, here JSON (any value, or a JSON Schema subset).

A model picks tokens; a grammar speaks of characters. Constrained decoding sits between them:

  1. schema.py   — a JSON Schema (subset: see its docstring for what is refused) -> a graph of grammar nodes.
  2. automaton.py — those nodes run as a pushdown automaton over *bytes* (a stack of frames for the nesting), a
                   state being the set of stacks it may be in; states are numbered and their byte transitions
                   memoised, so the automaton becomes a DFA over the states actually visited.
  3. vocab.py    — each token's bytes (a byte-level BPE token may be half a UTF-8 character) and a trie over them.
  4. masks.py    — state -> [V] bool mask of the tokens whose every byte the automaton can read, by one trie walk
                   per state (cached per state); and jump-forward: the bytes the grammar forces next are emitted as
                   tokens without a forward pass of their own.

The Engine keeps one ConstraintState per constrained request: before sampling, the logits of disallowed tokens
become -inf (so greedy and every sampling parameter work on the renormalised allowed set), the state advances with
each token, and the request ends as soon as the value is complete and nothing can follow (or with EOS, which is
allowed only once the value is complete).

    grammar = compile_grammar({"type": "object", "properties": {...}, "required": [...]}, vocab)
    state = grammar.start(); logits = state.apply(logits); ...; state.advance(token)
"""
from __future__ import annotations

import json
import threading
import weakref

from .automaton import DEAD, Automaton, ITEM_SEP, KEY_SEP
from .masks import ConstraintState, GrammarBudgetError, TokenGrammar
from .schema import SchemaError, compile_schema, dumps
from .vocab import Vocabulary

__all__ = ["Automaton", "ConstraintState", "TokenGrammar", "SchemaError", "GrammarBudgetError", "Vocabulary", "compile_schema",
           "compile_grammar", "dumps", "schema_key", "grammars_for", "GrammarCache", "ITEM_SEP", "KEY_SEP"]


def schema_key(schema) -> str:
    """A canonical text of a schema, to cache compiled grammars by. ValueError if it is not JSON."""
    try:
        return json.dumps(schema, sort_keys=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise SchemaError(f"the schema is not JSON: {e}") from None


def compile_grammar(schema, vocab: Vocabulary, **kwargs) -> TokenGrammar:
    return TokenGrammar(compile_schema(schema), vocab, **kwargs)


class GrammarCache:
    """The compiled grammars of one vocabulary, by schema: requests with the same schema share one grammar and so
    its cached masks. At most `max_bytes` of grammars (their packed masks and automaton states, TokenGrammar.nbytes)
    are kept, the least recently used forgotten first: a server sees endless schemas. Thread-safe: the server
    compiles a request's grammar in a worker thread (off the event loop and off the engine thread, with the start
    state's mask computed there too), and the engine thread then finds it here. The vocabulary (its trie, the slow
    part) is built once, by `vocabulary()`."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, max_bytes: int = 16 << 20):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        self.vocab: Vocabulary | None = None
        self.grammars: dict[str, TokenGrammar] = {}
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    def vocabulary(self) -> Vocabulary:
        with self._lock:
            if self.vocab is None:
                self.vocab = Vocabulary.of(self.tokenizer, self.vocab_size, self.eos_ids)
            return self.vocab

    def get(self, schema) -> TokenGrammar:
        """The grammar of `schema`, compiled (and its start mask computed) if new. SchemaError if refused."""
        key = schema_key(schema)
        with self._lock:
            grammar = self.grammars.pop(key, None)
            if grammar is not None:
                self.grammars[key] = grammar           # most recently used last
                return grammar
        grammar = compile_grammar(schema, self.vocabulary(), max_bytes=self.max_bytes // 4)
        try:
            if not grammar.mask(grammar.automaton.start).any():
                raise SchemaError("no JSON value satisfies this schema")
        except GrammarBudgetError as e:
            raise SchemaError(str(e)) from None
        with self._lock:
            self.grammars[key] = grammar
            self._evict()
        return grammar

    def nbytes(self) -> int:
        return sum(g.nbytes() for g in list(self.grammars.values()))

    def _evict(self) -> None:
        total = self.nbytes()
        while total > self.max_bytes and len(self.grammars) > 1:
            total -= self.grammars.pop(next(iter(self.grammars))).nbytes()


_CACHES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def grammars_for(tokenizer, vocab_size: int, eos_ids) -> GrammarCache:
    """The GrammarCache of this tokenizer (for a model of vocab_size V): one per tokenizer object, kept as long as
    the tokenizer lives, so every engine and request using it share the vocabulary trie and the masks."""
    with _CACHES_LOCK:
        per_tokenizer = _CACHES.setdefault(tokenizer, {})
        key = (vocab_size, tuple(eos_ids))
        if key not in per_tokenizer:
            per_tokenizer[key] = GrammarCache(tokenizer, vocab_size, eos_ids)
        return per_tokenizer[key]
