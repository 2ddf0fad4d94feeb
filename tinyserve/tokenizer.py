"""Text <-> token ids: the `tokenizers` library, the model's chat template, and streaming detokenisation."""
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

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) become their single id.
        No BOS is added: the chat template starts every turn with <|im_start|> itself."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

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
                out.append(f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n")
            out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

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


def load_tokenizer(path: str | Path = DEFAULT_WEIGHTS_DIR) -> Tokenizer:
    return Tokenizer(path)
