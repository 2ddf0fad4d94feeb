"""Lesson 10 exercises: the token mask of constrained decoding. Then run `make check-10`.

The reference answers are in tinyserve/constrained/masks.py and vocab.py: try first, peek later.
"""
from __future__ import annotations

import numpy as np

from tinyserve.constrained.automaton import DEAD, Automaton  # noqa: F401  (automaton.next(state, byte) -> state or DEAD)
from tinyserve.constrained.vocab import TrieNode  # noqa: F401  (a trie node: (token ids ending here, {byte: child}))


def apply_mask(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:   # [V], [V] bool -> [V]
    """The logits a sampler may draw from: unchanged where allowed, impossible elsewhere (same dtype, new array)."""
    raise NotImplementedError(
        "apply_mask: which logit makes exp(logit) exactly 0, so that greedy, temperature, top-k and top-p all "
        "renormalise over the allowed tokens? (0 is not it: an allowed token may have a negative logit)")


def is_plain(data: bytes) -> bool:
    """True if these bytes, written inside a JSON string's body, leave it a string body: whole UTF-8 characters,
    none of them '"', '\\\\', DEL or a control character (< 0x20)."""
    raise NotImplementedError(
        "is_plain: decode the bytes as UTF-8 first (what if that fails: half a character?), then look at each "
        "character")


def walk_trie(root: TrieNode, automaton: Automaton, sid: int, out: list[int]) -> None:
    """Append to `out` every token id of the trie whose bytes the automaton can read from state `sid`."""
    raise NotImplementedError(
        "walk_trie: go down the trie from the root, carrying the automaton's state along each edge "
        "(automaton.next); where a byte leads to DEAD, the whole subtree is impossible. A node's own ids are "
        "tokens too, not only the leaves'")


def auto_schema(functions: dict[str, dict], parallel: bool) -> dict:
    """tool_choice "auto" as one grammar: the JSON schema of an answer that is either {"tool_calls": [calls]} (each
    call {"name": N, "arguments": <N's parameters>}, N one of `functions`: name -> parameters schema; at most one
    call unless `parallel`) or {"response": "<text>"}: the model chooses with its first key."""
    raise NotImplementedError(
        "auto_schema: an anyOf of two objects, each with one required key. A call's 'name' is a const (one "
        "object per function, so each name brings its own 'arguments' schema); what does parallel=False bound?")
