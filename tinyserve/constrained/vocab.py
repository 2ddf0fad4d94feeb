"""The vocabulary as constrained decoding sees it: each token's bytes, and a trie over them.

Tokens are compared with the grammar as *bytes*, not characters: a byte-level BPE token may hold half of a UTF-8
character (SmolLM2 has tokens for lone lead and continuation bytes), and the automaton checks UTF-8 byte by byte,
so such a token is allowed exactly when some continuation can complete the character. Special tokens (their text
is a marker such as <|im_end|>, not output bytes) are never allowed, except EOS once the value is complete.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

TrieNode = tuple          # (token ids ending here: list[int], children: dict[byte, TrieNode])


def build_trie(items) -> TrieNode:
    """A byte trie of (token id, bytes) pairs: tokens sharing a prefix share the walk over it."""
    root: TrieNode = ([], {})
    for i, data in items:
        node = root
        for b in data:
            node = node[1].setdefault(b, ([], {}))
        node[0].append(i)
    return root


def is_plain(data: bytes) -> bool:
    """True if these bytes, inside a JSON string, leave the string body as it was: whole UTF-8 characters, none of
    them '"', '\\\\', DEL or a control character."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return not any(c in '"\\\x7f' or c < " " for c in text)


@dataclass
class Vocabulary:
    token_bytes: list[bytes | None]            # [V] None: a special token (or an id the tokenizer does not have)
    eos_ids: frozenset[int]
    encode: Callable[[str], list[int]] | None = None   # the tokenizer's, for jump-forward (None: no jump-forward)
    trie: TrieNode = field(init=False)         # every ordinary token
    inner_trie: TrieNode = field(init=False)   # only the tokens that are not plain (quote, backslash, partial UTF-8)
    plain: np.ndarray = field(init=False)      # [V] bool: the plain tokens
    plain_chars: np.ndarray = field(init=False)  # [V] int32: how many characters each plain token holds

    def __post_init__(self):
        tokens = [(i, b) for i, b in enumerate(self.token_bytes) if b]
        self.plain = np.zeros(len(self.token_bytes), dtype=bool)
        self.plain[[i for i, b in tokens if is_plain(b)]] = True
        self.plain_chars = np.zeros(len(self.token_bytes), dtype=np.int32)
        for i in np.flatnonzero(self.plain):
            self.plain_chars[i] = len(self.token_bytes[i].decode("utf-8"))
        self.trie = build_trie(tokens)
        self.inner_trie = build_trie((i, b) for i, b in tokens if not self.plain[i])

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    @classmethod
    def of(cls, tokenizer, vocab_size: int, eos_ids) -> "Vocabulary":
        """From a tokenizer with token_bytes() (tokenizer.py), padded to the model's vocab_size V."""
        data = list(tokenizer.token_bytes())[:vocab_size]
        data += [None] * (vocab_size - len(data))
        return cls(data, frozenset(int(e) for e in eos_ids), getattr(tokenizer, "encode", None))
