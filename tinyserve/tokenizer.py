"""Text <-> token ids: the `tokenizers` library, the model's chat template, streaming detokenisation, and the
character tokenizer of the random tiny model (tests, `--model tiny`)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from .chat_template import ChatTemplate
from .gguf_file import END_OF_GENERATION
from .weights import DEFAULT_WEIGHTS_DIR, WeightsError

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
GENERIC_SYSTEM_PROMPT = "You are a helpful assistant."


def default_system_prompt(tokenizer) -> str:
    """The system prompt a chat opens with when none is given: SmolLM2's own (its template and the ChatML fallback
    write it), a neutral one for a model whose template does not name it (a Llama must not be told it is SmolLM)."""
    template = getattr(tokenizer, "chat_template", None)
    return DEFAULT_SYSTEM_PROMPT if template is None or DEFAULT_SYSTEM_PROMPT in template.source \
        else GENERIC_SYSTEM_PROMPT


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The ids a prompt runs as: `text` encoded, with the model's BOS in front when its tokenizer asks for one
    (add_bos_token: Llama 3 and the SentencePiece models were trained with it; SmolLM2 and Qwen were not) and the
    text did not write it already (a chat template that starts with `{{ bos_token }}`): exactly one BOS, as
    Hugging Face's tokenizer gives a plain prompt, and never the double BOS llama.cpp warns about."""
    ids = tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_id", None)
    if getattr(tokenizer, "add_bos_token", False) and bos is not None and ids[:1] != [bos]:
        ids = [bos, *ids]
    return ids


class Tokenizer:
    """Text <-> token ids for a weights folder (tokenizer.json + tokenizer_config.json) or a GGUF file (built from
    the file's own vocabulary: gguf_tokenizer.py), with the model's chat template (chat_template.py)."""

    def __init__(self, path: str | Path = DEFAULT_WEIGHTS_DIR):
        from tokenizers import Tokenizer as HFTokenizer, decoders

        d = Path(path)
        if d.suffix == ".gguf" or d.is_file():
            from .gguf_tokenizer import load_gguf_tokenizer
            self._tok, cfg = load_gguf_tokenizer(d)
        else:
            if not (d / "tokenizer.json").exists():
                raise WeightsError(f"no tokenizer.json in {d}: run `make weights`")
            try:
                self._tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
            except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
                raise WeightsError(f"{d / 'tokenizer.json'} is corrupt ({e}); delete {d} and run `make weights`") from e
            cfg_path = d / "tokenizer_config.json"
            cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.source = d
        self.bos_token = cfg.get("bos_token", "<|im_start|>")
        self.eos_token = cfg.get("eos_token", "<|im_end|>")
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        # whether a plain prompt (no chat template) starts with BOS: SentencePiece models and Llama 3 want it
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.special_ids = frozenset(self._tok.token_to_id(t) for t in cfg.get("additional_special_tokens", []))
        self.vocab_size = self._tok.get_vocab_size()
        self._tok_plain = None   # the same tokenizer reading special-token markers as plain text (built on demand)
        # The hand-written ChatML below is only the fallback for a model that ships no template
        source = cfg.get("chat_template")
        self.chat_template = None if not source else ChatTemplate(source, {
            k: cfg.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")})
        # Byte-level BPE has no unknown token: a byte whose symbol is not in the vocabulary is silently dropped.
        # SmolLM2 lacks 21 (six ASCII control characters, and bytes that valid UTF-8 never or almost never uses),
        # so `encode` refuses text containing them instead of handing the model something else than was typed.
        # (SentencePiece vocabularies fall back to byte tokens instead: nothing is missing.)
        self.byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        self._missing_bytes = bytes(b for b, ch in enumerate(_byte_level_symbols())
                                    if self.byte_level and self._tok.token_to_id(ch) is None)
        # the ids that end a generation, as llama.cpp decides them (gguf_file.END_OF_GENERATION)
        self.stop_ids = frozenset(i for t in (self.eos_token, *END_OF_GENERATION)
                                  if t and (i := self._tok.token_to_id(t)) is not None)

    def encode(self, text: str, *, add_bos: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. <|im_start|>) become their single id
        unless parse_special=False (then they are text like any other, as llama.cpp's parse_special=false).
        No BOS unless add_bos: a chat template writes its own (`add_bos=tok.add_bos_token` for a plain prompt)."""
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
        tok = self._tok
        if not parse_special:
            if self._tok_plain is None:
                from tokenizers import Tokenizer as HFTokenizer
                self._tok_plain = HFTokenizer.from_str(self._tok.to_str())
                self._tok_plain.encode_special_tokens = True
            tok = self._tok_plain
        ids = tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

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
            if i in added or piece is None:
                out.append(None)
            elif not self.byte_level:   # SentencePiece: '▁' is a space, <0xXX> one byte (its byte fallback)
                is_byte = len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
                out.append(bytes([int(piece[3:5], 16)]) if is_byte else piece.replace("\u2581", " ").encode())
            else:
                ok = all(ch in byte_of for ch in piece)
                out.append(bytes(byte_of[ch] for ch in piece) if ok else None)
        return out

    def max_token_chars(self) -> int:
        """The most characters one token can stand for: a text longer than this times a context cannot fit in it
        (a byte-level symbol is one byte, and a character is at least one byte)."""
        return max(len(symbol) for symbol in self._tok.get_vocab(with_added_tokens=True))

    @property
    def template_supports_tools(self) -> bool:
        """Whether the chat template reads `tools` (so apply_chat_template can show the model its tools)."""
        return self.chat_template is not None and self.chat_template.reads_tools

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tools: Sequence[dict] | None = None, **template_kwargs) -> str:
        """The prompt text of a conversation, rendered by the model's own chat template as Hugging Face's
        apply_chat_template renders it. Messages are dicts with 'role' and 'content'; an assistant message may
        carry 'tool_calls' instead of content, a 'tool' message its 'tool_call_id': both reach the template as
        given. `tools`: JSON schemas ({"type": "function", "function": {...}}), for a template that reads them.

        A model without a template (none in its tokenizer_config.json or GGUF) gets ChatML, SmolLM2's format,
        written out below as the fallback:

            <|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n

        (a conversation that does not open with a system message gets the default one).
        """
        _check_messages(messages)
        if tools and not self.template_supports_tools:
            raise ValueError("this model's chat template does not read `tools`: it cannot be shown tools")
        if self.chat_template is not None:
            return self.chat_template.render(messages, add_generation_prompt, tools, **template_kwargs)
        out = []
        for i, m in enumerate(messages):
            if i == 0 and m["role"] != "system":
                out.append(_chatml_turn("system", DEFAULT_SYSTEM_PROMPT))
            out.append(_chatml_turn(m["role"], m.get("content") or ""))
        if add_generation_prompt:
            out.append(_CHATML_ASSISTANT)
        return "".join(out)

    # `python -m tinyserve chat` grows its prompt turn by turn as token ids (chat.py): these give the text each step
    # adds, cut out of the template's own renderings of placeholder conversations, so that the ids equal those of
    # the whole conversation rendered at once. That needs a template that renders a conversation as the
    # concatenation of its turns: `_delta` refuses one that does not (Mistral's moves the system prompt into the
    # last user turn). The ids match too when each turn is encoded with encode_after (the boundary between two
    # turns is split as in one piece).
    _SYSTEM = {"role": "system", "content": "\x00system\x00"}   # \x00: cannot occur in a template's own text
    _USER = {"role": "user", "content": "\x00user\x00"}

    def _delta(self, before: list[dict], after: list[dict], gen_before: bool, gen_after: bool,
               foreign: tuple[dict, ...] = ()) -> str:
        a = self._render(before, gen_before) if before else ""
        b = self._render(after, gen_after)
        delta = b[len(a):]
        if not b.startswith(a) or any(m["content"] in delta for m in foreign):
            raise ValueError("this chat template does not render a conversation turn by turn; the chat command "
                             "cannot grow its prompt from the previous one")
        return delta

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The template's text, without the EOS some templates (Phi-3.5) put after a finished conversation only:
        a turn that will be continued does not end with it."""
        text = self.chat_template.render(messages, add_generation_prompt)
        if add_generation_prompt or not self.eos_token or not text.endswith(self.eos_token):
            return text
        probe = [self._SYSTEM, self._USER]
        finished, continued = self.chat_template.render(probe, False), self.chat_template.render(probe, True)
        closes_with_eos = finished.endswith(self.eos_token) and not continued.startswith(finished)
        return text[:-len(self.eos_token)] if closes_with_eos else text

    def render_turn(self, role: str, content: str) -> str:
        """One finished turn (a system turn opens the conversation, with whatever the template puts first)."""
        if self.chat_template is None:
            return _chatml_turn(role, content)
        turn = {"role": role, "content": content}
        if role == "system":
            return self._delta([], [turn], False, False)
        return self._delta([self._SYSTEM], [self._SYSTEM, turn], False, False, foreign=(self._SYSTEM,))

    def assistant_header(self) -> str:
        """What the model's reply follows (the generation prompt): the opening of an assistant turn."""
        if self.chat_template is None:
            return _CHATML_ASSISTANT
        return self._delta([self._SYSTEM, self._USER], [self._SYSTEM, self._USER], False, True,
                           foreign=(self._SYSTEM, self._USER))

    def close_turn(self, reply: list[int]) -> list[int]:
        """The ids that end an assistant turn after the model's `reply` ids (ChatML: <|im_end|>\n; the end marker
        only if the model did not emit it itself)."""
        if self.chat_template is None:
            end = _CHATML_END
        else:
            marker = "\x00reply\x00"
            msgs = [self._SYSTEM, self._USER, {"role": "assistant", "content": marker}]
            whole = self._render(msgs, False)
            end = whole[whole.index(marker) + len(marker):] if marker in whole else ""
        ids = self.encode(end)
        # the model's own end marker (<|im_end|>, <|eot_id|>, </s>) stands for the template's: keep what follows it
        last = reply[-1] if reply else None
        if last in ids and (last in self.special_ids or last in self.stop_ids):
            return ids[ids.index(last) + 1:]
        return ids

    def encode_after(self, history: Sequence[int], text: str) -> list[int]:
        """The ids `text` adds after the `history` ids, split as encoding the whole conversation at once would split
        them. The tokenizer cuts text at special tokens and encodes each piece alone, so the piece `text` continues
        is the history after its last special token: that tail is encoded again together with `text` (where it
        would merge across the boundary, e.g. SentencePiece's '\\n<|user|>'), and must come out as it was."""
        start = next((i + 1 for i in range(len(history) - 1, -1, -1) if history[i] in self.special_ids), None)
        if start is None:
            return self.encode(text)
        tail = list(history[start:])
        # decoded alone, the tail loses the one space SentencePiece put in front of a piece: encode puts it back
        ids = self.encode(self.decode(tail) + text)
        return ids[len(tail):] if ids[:len(tail)] == tail else self.encode(text)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None) -> list[int]:
        """The ids of a conversation as a prompt: the template's text, with the BOS prompt_ids adds."""
        return prompt_ids(self, self.apply_chat_template(messages, add_generation_prompt, tools))

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


_CHATML_ASSISTANT = "<|im_start|>assistant\n"
_CHATML_END = "<|im_end|>\n"


def _chatml_turn(role: str, content: str) -> str:
    """One finished ChatML turn: <|im_start|>{role}\n{content}<|im_end|>\n (the fallback template)."""
    return f"<|im_start|>{role}\n{content}{_CHATML_END}"


def _check_messages(messages) -> None:
    """A clear error for what a template would otherwise fail on deep inside jinja (or render as 'None')."""
    if not messages:
        raise ValueError("apply_chat_template: no messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a 'role' string and 'content', got {m!r}")
        if "content" not in m and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ValueError(f"message {i} ({m['role']}) has no 'content' (only an assistant message with "
                             f"'tool_calls' may omit it)")


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

    def max_token_chars(self) -> int:
        return 1

    def token_bytes(self) -> list[bytes | None]:
        return [None] * 3 + [chr(i).encode() for i in range(3, self.vocab_size)]

    template_supports_tools = False

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None) -> str:
        _check_messages(messages)
        if tools:
            raise ValueError("the tiny model's chat format cannot show tools")
        return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + (
            "assistant: " if add_generation_prompt else "")

    def stream_decoder(self, skip_special_tokens: bool = True):
        return StreamDecoder(self, skip_special_tokens)
