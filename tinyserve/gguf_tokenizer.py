"""A `tokenizers` tokenizer built from a GGUF file's own vocabulary, the way llama.cpp tokenizes with it.

A GGUF carries its tokenizer as metadata, not as a tokenizer.json: `tokenizer.ggml.model` says which algorithm
(`gpt2`: byte-level BPE with merges; `llama`: SentencePiece-style BPE over scores with byte fallback), the token
strings, their types and scores, the merges, the special ids, and `tokenizer.ggml.pre`, the *name* of the
pre-tokenizer (the regexes that cut text into words before BPE runs inside each word). llama.cpp keeps the regex
of every name in its source (llama-vocab.cpp); `PRE_TOKENIZER_REGEXES` below holds the ones of the families
tinyserve runs. Proven against llama.cpp's own test vectors (tests/test_gguf_tokenizer.py).

    vocab = read_vocab(gguf_metadata(path), path)    # what the file says (a GGUFReader works too)
    tok = build_tokenizer(vocab)                     # a tokenizers.Tokenizer that encodes and decodes like llama.cpp
    json_str, tokenizer_config = tokenizer_json_from_gguf(gguf.GGUFReader(path))   # weights.convert_gguf's contract
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from .gguf_file import END_OF_GENERATION, WeightsError, read_header


class TokenType(IntEnum):
    """llama.cpp's token types (`tokenizer.ggml.token_type`)."""
    NORMAL = 1
    UNKNOWN = 2         # <unk>, and the padding rows some vocabularies carry ([PAD32011])
    CONTROL = 3         # <|im_start|>, <s>: written by templates, never produced by splitting text
    USER_DEFINED = 4    # added to the vocabulary by hand: matched in the text before anything else
    UNUSED = 5
    BYTE = 6            # <0x0A>: SentencePiece's byte fallback


# The regexes of llama.cpp's pre-tokenizers, applied one after the other: each cuts every piece the previous one
# left (llama-vocab.cpp, llm_tokenizer_bpe). The apostrophe alternatives spell out both cases because llama.cpp's
# regex engine has no (?i:...).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT = r"\p{N}"

PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    # llama.cpp's fallback for a BPE file that names none: punctuation runs, GPT-2's words, digit runs, digit triples
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe"), (_GPT2,)),
    # every digit its own word, then GPT-2's regex (SmolLM2, StarCoder)
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    (_DIGIT, _GPT2)),
    # Llama 3.x: numbers in groups of up to three digits, a letter run may take one leading non-letter
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe"), (_LLAMA3,)),
    # Qwen2, Qwen2.5, Qwen3: as Llama 3's, but every digit alone
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (_QWEN2,)),
    "qwen35": (_QWEN35,),
}
# llama.cpp's 'llama3' family takes a word that is a whole token as that token, whatever the merges would build
# (tokenizers: BPE(ignore_merges=True)); the others always merge
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"}
_ADD_BOS_BPE = {"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"}   # llama.cpp's default before the file's key


@dataclass(slots=True)
class GGUFVocab:
    """What a GGUF says about its tokenizer (the `tokenizer.*` keys); V tokens."""
    source: str                      # the file, for error messages
    name: str                        # general.name (llama.cpp adjusts a few models' special tokens by name)
    model: str                       # tokenizer.ggml.model: "gpt2" | "llama"
    pre: str                         # tokenizer.ggml.pre (BPE only): which regexes cut the text into words
    tokens: list[str]                # [V]
    types: list[int]                 # [V] TokenType
    scores: list[float] | None       # [V] SentencePiece: the higher, the earlier two pieces merge into it
    merges: list[tuple[str, str]]    # BPE: ranked pairs, first merged first
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool                    # whether a plain prompt starts with BOS (llama.cpp's add_special)
    add_space_prefix: bool           # SentencePiece: the text gets a leading space, as every word has one
    chat_template: str | None

    def _is_special(self, token: str, type_: int) -> bool:
        return type_ in (TokenType.CONTROL, TokenType.UNKNOWN) or token in END_OF_GENERATION

    @property
    def special_tokens(self) -> list[str]:
        """Control and unknown tokens (and any end-of-generation marker): templates write them, and text becomes
        them only where special tokens are parsed."""
        return [t for t, ty in zip(self.tokens, self.types) if self._is_special(t, ty)]

    @property
    def user_defined_tokens(self) -> list[str]:
        """Tokens added by hand: matched in any text before anything else."""
        return [t for t, ty in zip(self.tokens, self.types)
                if ty == TokenType.USER_DEFINED and not self._is_special(t, ty)]

    @property
    def rstrip_tokens(self) -> set[str]:
        """Added tokens that swallow the whitespace after them: llama.cpp sets this by model name, for Phi-3 only
        (its template writes '<|end|>\\n', and the newline is not part of the next turn)."""
        if "phi-3" not in self.name.lower() and "phi3" not in self.name.lower():
            return set()
        return ({*self.special_tokens, *self.user_defined_tokens, "</s>"} - {"<unk>", "<s>", "<|endoftext|>"})

    def token(self, i: int | None) -> str | None:
        return self.tokens[i] if i is not None and 0 <= i < len(self.tokens) else None


def gguf_metadata(path: str | Path) -> dict:
    """The key/value header of a GGUF file, without its tensors: {key: int | float | bool | str | list}
    (gguf_file.read_header: one pass over a memory map, not an object per vocabulary entry)."""
    import struct

    p = Path(path)
    try:
        return read_header(p).meta
    except FileNotFoundError:
        raise WeightsError(f"no such GGUF file: {p}") from None
    except (ValueError, struct.error, OverflowError, OSError) as e:   # truncated, empty or not a GGUF at all
        raise WeightsError(f"{p} is not a readable GGUF file: {e}") from None


_TOKENIZER_KEYS = ("general.name", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                   "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                   "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                   "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
                   "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")


def _reader_metadata(reader) -> dict:
    """The tokenizer keys of an open gguf.GGUFReader, as gguf_metadata gives them."""
    out = {}
    for key in _TOKENIZER_KEYS:
        f = reader.fields.get(key)
        if f is None:
            continue
        if f.types and f.types[0].name == "ARRAY":
            if f.types[-1].name == "STRING":
                out[key] = [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
            else:
                out[key] = [f.parts[i][0].item() for i in f.data]
        else:
            out[key] = f.contents()
    return out


def read_vocab(metadata, source: str | Path = "GGUF") -> GGUFVocab:
    """The tokenizer of a GGUF, from its metadata (gguf_metadata's dict, or an open gguf.GGUFReader); a
    WeightsError naming `source` if it has none or one tinyserve cannot run."""
    meta = _reader_metadata(metadata) if hasattr(metadata, "fields") else metadata
    get = lambda key, default=None: meta.get(f"tokenizer.ggml.{key}", default)  # noqa: E731
    model, tokens = get("model"), get("tokens")
    if model is None or tokens is None:
        raise WeightsError(f"{source} has no tokenizer (no tokenizer.ggml.model/tokens keys): use a GGUF converted "
                           f"with its tokenizer, or a weights folder with tokenizer.json")
    if model not in ("gpt2", "llama"):
        raise WeightsError(f"{source}: tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2' "
                           f"byte-level BPE, 'llama' SentencePiece)")
    types = get("token_type", [TokenType.NORMAL] * len(tokens))
    scores = get("scores")
    merges: list[tuple[str, str]] = []
    pre = get("pre", "default") if model == "gpt2" else "default"
    if model == "gpt2":
        if get("merges") is None:
            raise WeightsError(f"{source}: a BPE tokenizer without tokenizer.ggml.merges")
        for m in get("merges"):
            cut = m.find(" ", 1)     # a piece may itself be a space (non-byte-level vocabularies): split after it
            merges.append((m[:cut], m[cut + 1:]))
        if pre not in PRE_TOKENIZER_REGEXES:
            raise WeightsError(f"{source}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported (supported: "
                               f"{', '.join(sorted(PRE_TOKENIZER_REGEXES))})")
    elif scores is None:
        raise WeightsError(f"{source}: a SentencePiece ('llama') tokenizer without tokenizer.ggml.scores")
    if len(types) != len(tokens) or (scores is not None and len(scores) != len(tokens)):
        raise WeightsError(f"{source}: tokenizer.ggml.tokens, token_type and scores differ in length")

    def token_id(key):
        i = get(f"{key}_token_id")
        return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

    default_bos = model == "llama" or pre in _ADD_BOS_BPE
    return GGUFVocab(
        source=str(source), name=str(meta.get("general.name", "")), model=model, pre=pre, tokens=list(tokens),
        types=[int(t) for t in types],
        scores=[float(x) for x in scores] if scores is not None else None, merges=merges,
        bos_id=token_id("bos"), eos_id=token_id("eos"), unk_id=token_id("unknown"), pad_id=token_id("padding"),
        add_bos=bool(get("add_bos_token", default_bos)),
        add_space_prefix=bool(get("add_space_prefix", model == "llama")),
        chat_template=meta.get("tokenizer.chat_template"))


def _spm_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """SentencePiece merges two neighbouring pieces whose concatenation is a token, highest score first
    (llama.cpp's llm_tokenizer_spm). A BPE model does the same if every way of splitting each token into two
    tokens is a merge, ranked by the merged token's score."""
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    ranked: list[tuple[float, int, int]] = []   # (-score of the merged token, left id, right id)
    for t, score in zip(vocab.tokens, vocab.scores):
        if len(t) > 1:   # a comprehension: this loop visits every split of every token (1.5M for Gemma 3)
            ranked += [(-score, ids[a], ids[b]) for k in range(1, len(t))
                       if (a := t[:k]) in ids and (b := t[k:]) in ids]
    ranked.sort()
    return [(vocab.tokens[a], vocab.tokens[b]) for _, a, b in ranked]


def build_tokenizer(vocab: GGUFVocab):
    """A `tokenizers.Tokenizer` that encodes and decodes as llama.cpp does with the same vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    ids = {t: i for i, t in enumerate(vocab.tokens)}
    if vocab.model == "gpt2":
        tok = Tokenizer(models.BPE(vocab=ids, merges=vocab.merges, ignore_merges=vocab.pre in _IGNORE_MERGES))
        regexes = PRE_TOKENIZER_REGEXES[vocab.pre]
        if regexes[-1] == _GPT2:
            # GPT-2's regex is the one ByteLevel applies itself: the same split, in the form the shipped
            # SmolLM2 tokenizer.json has always had
            splits = [pre_tokenizers.Digits(individual_digits=True) if r == _DIGIT
                      else pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes[:-1]]
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
        tok.decoder = decoders.ByteLevel()
    else:
        unk = vocab.token(vocab.unk_id)
        tok = Tokenizer(models.BPE(vocab=ids, merges=_spm_merges(vocab), unk_token=unk, byte_fallback=True,
                                   fuse_unk=True))
        # SentencePiece sees a space as '▁' and (add_space_prefix) starts the text with one, as if every word,
        # the first included, followed a space; decoding turns '▁' back into spaces and drops that first one
        steps = [normalizers.Prepend("▁")] if vocab.add_space_prefix else []
        tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
        steps = [decoders.Strip(content=" ", left=1, right=0)] if vocab.add_space_prefix else []
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *steps])
    # Control tokens are matched in the text only where special tokens are wanted (a chat template's markers);
    # user-defined ones always, before anything else, as llama.cpp's tokenizer_st_partition does
    rstrip = vocab.rstrip_tokens
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=t in rstrip)
                            for t in vocab.special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False, rstrip=t in rstrip)
                    for t in vocab.user_defined_tokens])
    return tok


def tokenizer_config(vocab: GGUFVocab) -> dict:
    """The tokenizer_config.json of a converted folder: special tokens and the chat template."""
    return {"chat_template": vocab.chat_template, "bos_token": vocab.token(vocab.bos_id),
            "eos_token": vocab.token(vocab.eos_id), "pad_token": vocab.token(vocab.pad_id),
            "unk_token": vocab.token(vocab.unk_id), "additional_special_tokens": vocab.special_tokens,
            "add_bos_token": vocab.add_bos}


def tokenizer_json_from_gguf(reader, source: str | Path = "GGUF") -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config dict) of an open GGUFReader: `weights.build_tokenizer_json`'s
    contract for any supported vocabulary."""
    vocab = read_vocab(reader, source)
    return build_tokenizer(vocab).to_str(), tokenizer_config(vocab)


def load_gguf_tokenizer(path: str | Path):
    """(tokenizers.Tokenizer, tokenizer_config dict) straight from a GGUF file."""
    vocab = read_vocab(gguf_metadata(path), path)
    return build_tokenizer(vocab), tokenizer_config(vocab)
