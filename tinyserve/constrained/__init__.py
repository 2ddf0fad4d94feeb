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

from .automaton import Automaton, ITEM_SEP, KEY_SEP
from .masks import ConstraintState, TokenGrammar
from .schema import SchemaError, compile_schema, dumps
from .vocab import Vocabulary

__all__ = ["Automaton", "ConstraintState", "TokenGrammar", "SchemaError", "Vocabulary", "compile_schema",
           "compile_grammar", "dumps", "schema_key", "ITEM_SEP", "KEY_SEP"]


def schema_key(schema) -> str:
    """A canonical text of a schema, to cache compiled grammars by. ValueError if it is not JSON."""
    try:
        return json.dumps(schema, sort_keys=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise SchemaError(f"the schema is not JSON: {e}") from None


def compile_grammar(schema, vocab: Vocabulary) -> TokenGrammar:
    return TokenGrammar(compile_schema(schema), vocab)
