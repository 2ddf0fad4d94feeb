"""Text <-> token ids: the `tokenizers` library, the model's chat template, streaming detokenisation, and the
character tokenizer of the random tiny model (tests, `--model tiny`)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from .weights import DEFAULT_WEIGHTS_DIR, WeightsError

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class Tokenizer:
    def __init__(self, path: str | Path = DEFAULT_WEIGHTS_DIR):
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(path)
        if not (d / "tokenizer.json").exists():
            raise WeightsError(f"no tokenizer.json in {d}: run `make weights`")
        try:
            self._tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
            raise WeightsError(f"{d / 'tokenizer.json'} is corrupt ({e}); delete {d} and run `make weights`") from e
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token = cfg.get("bos_token", "<|im_start|>")
        self.eos_token = cfg.get("eos_token", "<|im_end|>")
        self.bos_id = self._tok.token_to_id(self.bos_token)
        self.eos_id = self._tok.token_to_id(self.eos_token)
        self.special_ids = frozenset(self._tok.token_to_id(t) for t in cfg.get("additional_special_tokens", []))
        self.vocab_size = self._tok.get_vocab_size()
        # Byte-level BPE has no unknown token: a byte whose symbol is not in the vocabulary is silently dropped.
        # SmolLM2 lacks 21 (six ASCII control characters, and bytes that valid UTF-8 never or almost never uses),
        # so `encode` refuses text containing them instead of handing the model something else than was typed.
        self._missing_bytes = bytes(b for b, ch in enumerate(_byte_level_symbols()) if self._tok.token_to_id(ch) is None)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) become their single id.
        No BOS is added: the chat template starts every turn with <|im_start|> itself."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError as e:   # a lone surrogate, e.g. from a badly decoded file
            raise ValueError(f"the text is not valid Unicode at index {e.start}: {text[e.start]!r}") from None
        if raw.translate(None, self._missing_bytes) != raw:
            bad = next(i for i, ch in enumerate(text) if ch.encode("utf-8").translate(None, self._missing_bytes)
                       != ch.encode("utf-8"))
            raise ValueError(f"the text contains {text[bad]!r} (U+{ord(text[bad]):04X}) at index {bad}, which the "
                             f"model's vocabulary cannot represent; remove or replace it")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def token_bytes(self) -> list[bytes | None]:
        """[V] the bytes each token stands for (byte-level BPE: a token may be part of a UTF-8 character), None for
        the added (special) tokens, whose text is a marker, not bytes of the output. Constrained decoding needs it."""
        byte_of = {ch: b for b, ch in enumerate(_byte_level_symbols())}
        added = self._tok.get_added_tokens_decoder()
        out: list[bytes | None] = []
        for i in range(self.vocab_size):
            piece = self._tok.id_to_token(i)
            ok = i not in added and piece is not None and all(ch in byte_of for ch in piece)
            out.append(bytes(byte_of[ch] for ch in piece) if ok else None)
        return out

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """SmolLM2's ChatML template (the GGUF's Jinja template, written out in Python):

            <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n

        A conversation that does not open with a system message gets the default one.
        """
        if not messages:
            raise ValueError("apply_chat_template: no messages")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
            if i == 0 and m["role"] != "system":
                out.append(self.render_turn("system", DEFAULT_SYSTEM_PROMPT))
            out.append(self.render_turn(m["role"], m["content"]))
        if add_generation_prompt:
            out.append(self.assistant_header())
        return "".join(out)

    @staticmethod
    def render_turn(role: str, content: str) -> str:
        """One finished ChatML turn: <|im_start|>{role}\\n{content}<|im_end|>\\n."""
        return f"<|im_start|>{role}\n{content}<|im_end|>\n"

    @staticmethod
    def assistant_header() -> str:
        """What the model's reply follows (the generation prompt): the opening of an assistant turn."""
        return "<|im_start|>assistant\n"

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


@dataclass(slots=True)
class StreamDecoder:
    """Turns a stream of token ids into a stream of text pieces.

    Decoding token by token is wrong twice over: a character outside ASCII may span several byte-level tokens
    (decode one alone and you print U+FFFD), and some decoders treat the first token of a sequence specially.
    So we decode a window that starts a few tokens back and emit only the new text, holding it back while it
    ends in an incomplete UTF-8 character.
    """
    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0   # decode from here (context so spacing is right)
    read_offset: int = 0     # text up to here has been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        text = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if text.endswith("\ufffd") or len(text) <= len(prefix):
            return ""  # an unfinished multi-byte character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (even if it is not valid UTF-8)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        text = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]

    def extend(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)


def _byte_level_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the printable symbol that stands for each byte 0..255 in the vocabulary
    (printable Latin-1 bytes stand for themselves, the others are shifted to U+0100 onwards, in byte order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    symbols, shifted = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def load_tokenizer(path: str | Path = DEFAULT_WEIGHTS_DIR) -> Tokenizer:
    return Tokenizer(path)


class CharTokenizer:
    """For `--model tiny` (a random 256-token model): token id i is the character chr(i), ids 0-2 are special
    (2 = EOS). Enough to exercise the server end to end in milliseconds; its outputs are random characters."""

    def __init__(self, vocab_size: int = 256, eos_id: int = 2):
        self.vocab_size, self.eos_id, self.bos_id = vocab_size, eos_id, 1
        self.eos_token = "</s>"

    def encode(self, text: str) -> list[int]:
        bad = next((c for c in text if not 3 <= ord(c) < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"the tiny model's tokenizer only knows characters U+0003..U+{self.vocab_size - 1:04X}, "
                             f"got {bad!r}")
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i >= 3 or not skip_special_tokens)

    def token_bytes(self) -> list[bytes | None]:
        return [None] * 3 + [chr(i).encode() for i in range(3, self.vocab_size)]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt
                                                                             else "")

    def stream_decoder(self, skip_special_tokens: bool = True):
        return StreamDecoder(self, skip_special_tokens)
