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
import weakref

from .automaton import DEAD, Automaton, ITEM_SEP, KEY_SEP
from .masks import ConstraintState, TokenGrammar
from .schema import SchemaError, compile_schema, dumps
from .vocab import Vocabulary

__all__ = ["Automaton", "ConstraintState", "TokenGrammar", "SchemaError", "Vocabulary", "compile_schema",
           "compile_grammar", "dumps", "schema_key", "grammars_for", "GrammarCache", "ITEM_SEP", "KEY_SEP"]


def schema_key(schema) -> str:
    """A canonical text of a schema, to cache compiled grammars by. ValueError if it is not JSON."""
    try:
        return json.dumps(schema, sort_keys=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise SchemaError(f"the schema is not JSON: {e}") from None


def compile_grammar(schema, vocab: Vocabulary) -> TokenGrammar:
    return TokenGrammar(compile_schema(schema), vocab)


class GrammarCache:
    """The compiled grammars of one vocabulary, by schema: requests with the same schema share one grammar and so
    its cached masks. The vocabulary (its trie: ~1 s for 49,152 tokens) is built at the first schema."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, max_grammars: int = 256):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        self.vocab: Vocabulary | None = None
        self.grammars: dict[str, TokenGrammar] = {}
        self.max_grammars = max_grammars

    def get(self, schema) -> TokenGrammar:
        key = schema_key(schema)
        if key not in self.grammars:
            if self.vocab is None:
                self.vocab = Vocabulary.of(self.tokenizer, self.vocab_size, self.eos_ids)
            if len(self.grammars) >= self.max_grammars:   # a server sees endless schemas: forget the oldest
                self.grammars.pop(next(iter(self.grammars)))
            self.grammars[key] = compile_grammar(schema, self.vocab)
        return self.grammars[key]


_CACHES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def grammars_for(tokenizer, vocab_size: int, eos_ids) -> GrammarCache:
    """The GrammarCache of this tokenizer (for a model of vocab_size V): one per tokenizer object, kept as long as
    the tokenizer lives, so every engine and request using it share the vocabulary trie and the masks."""
    per_tokenizer = _CACHES.setdefault(tokenizer, {})
    key = (vocab_size, tuple(eos_ids))
    if key not in per_tokenizer:
        per_tokenizer[key] = GrammarCache(tokenizer, vocab_size, eos_ids)
    return per_tokenizer[key]
