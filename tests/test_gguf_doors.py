"""A GGUF through every door (generate, generate --chat, chat, serve, bench, the Engine): the tokenizer's BOS, the
file's end-of-generation tokens and its own chat template reach the model, whatever the family.

The files are tiny (one layer, D=64) but carry llama.cpp's real vocabularies (llama-bpe for Llama 3, qwen2 for
Qwen2.5 and Qwen3, llama-spm for TinyLlama) and the families' chat templates; their weights make greedy decoding
answer the family's end-of-turn token at every position (make_gguf_fixtures.answering_tensors). So a generation
that stops after one token proves the stop id reached the stop check, and the same request with ignore_eos runs on
to its budget (the model does keep answering it: the check can fail). No real weights are needed; the real SmolLM2 files are checked in
docs/your-own-model.md and tests/test_gguf_invariance.py.
"""
from __future__ import annotations

import io
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import numpy as np
import pytest

import tinyserve as ts
import tinyserve.__main__ as cli
from tinyserve.sampling import SamplingParams
from tinyserve.tokenizer import prompt_ids

from tests.llama_cpp_files import llama_cpp_dir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from make_gguf_fixtures import SHAPES, write_gguf  # noqa: E402

TEMPLATES = json.loads((Path(__file__).parent / "fixtures" / "chat_templates.json").read_text())["templates"]
NUMPY = ["--quant", "none", "--backend", "numpy"]    # the float32 reference: no kernels to compile for D=64


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    shape: str            # make_gguf_fixtures.SHAPES: the vocabulary it takes from llama.cpp's vocab GGUFs
    template: str | None  # tests/fixtures/chat_templates.json (None: the file has none, ChatML is the fallback)
    end: str              # the token a finished turn ends with: the model always answers it
    bos: str | None       # the BOS a plain prompt must start with (None: the tokenizer adds none)


FAMILIES = {f.name: f for f in [
    Family("llama3", "llama-3.2-1b", "meta-llama-Llama-3.2-3B-Instruct", "<|eot_id|>", "<|begin_of_text|>"),
    Family("qwen2", "qwen2.5-0.5b", "Qwen-Qwen2.5-7B-Instruct", "<|im_end|>", None),
    Family("qwen3", "qwen3-0.6b", "Qwen-Qwen3-0.6B", "<|im_end|>", None),
    Family("tinyllama", "tinyllama-1.1b", None, "</s>", "<s>"),
]}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    out, vocabs = tmp_path_factory.mktemp("doors"), llama_cpp_dir() / "models"
    paths = {}
    for f in FAMILIES.values():
        shape = replace(SHAPES[f.shape], dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96, n_layers=1)
        tok = _vocab_tokenizer(vocabs / shape.vocab_file)
        paths[f.name] = out / f"{f.name}.gguf"
        write_gguf(paths[f.name], shape, "F16", vocab_dir=vocabs, answer=tok.token_to_id(f.end),
                   chat_template=TEMPLATES[f.template]["template"] if f.template else None)
    return paths


def _vocab_tokenizer(path: Path):
    from tinyserve.gguf_tokenizer import build_tokenizer, gguf_metadata, read_vocab
    return build_tokenizer(read_vocab(gguf_metadata(path), path))


def loaded(files, name):
    return ts.load_tokenizer(files[name]), ts.load_model(files[name], quant="none", backend="numpy")


def run_cli(capsys, *argv: str, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def check_bos(tok, family: Family, ids: list[int]) -> None:
    """Exactly one BOS, first, where the tokenizer asks for it (add_bos_token); none where it does not."""
    if family.bos is None:
        assert not tok.add_bos_token and tok.bos_id not in ids[:1]
    else:
        assert tok.add_bos_token and tok.id_to_token(ids[0]) == family.bos
        assert ids.count(tok.bos_id) == 1


# --- generate ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_generate_a_plain_prompt_gets_the_bos_and_stops_at_the_end_of_turn(files, name, capsys):
    f, tok = FAMILIES[name], ts.load_tokenizer(files[name])
    rc, out, err = run_cli(capsys, "generate", "--model", str(files[name]), *NUMPY, "--json",
                           "--max-new-tokens", "6", "Hello world")
    assert rc == 0, err
    answer = json.loads(out)
    check_bos(tok, f, answer["prompt_ids"])
    assert answer["prompt_ids"][-len(tok.encode("Hello world")):] == tok.encode("Hello world")
    assert answer["output_ids"] == [tok._tok.token_to_id(f.end)]      # stopped at the family's end of turn


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_chat_renders_the_files_template(files, name, capsys):
    f, tok = FAMILIES[name], ts.load_tokenizer(files[name])
    rc, out, err = run_cli(capsys, "generate", "--model", str(files[name]), *NUMPY, "--json", "--chat",
                           "--max-new-tokens", "6", "Hi")
    assert rc == 0, err
    answer = json.loads(out)
    ids = answer["prompt_ids"]
    check_bos(tok, f, ids)
    text = tok.decode(ids)
    if f.template is None:                  # no template in the file: the ChatML fallback
        assert tok.chat_template is None and text.endswith("<|im_start|>assistant\n")
    else:                                   # the file's own, rendered as Hugging Face renders it
        assert tok.chat_template.source == TEMPLATES[f.template]["template"]
        assert ids == prompt_ids(tok, tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
        assert text.endswith({"llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                              "qwen2": "<|im_start|>assistant\n", "qwen3": "<|im_start|>assistant\n"}[name])
    assert answer["output_ids"] == [tok._tok.token_to_id(f.end)]


# --- the Engine ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_the_engine_stops_at_the_files_end_of_generation_tokens(files, name):
    f = FAMILIES[name]
    tok, model = loaded(files, name)
    end = tok._tok.token_to_id(f.end)
    assert end in tok.stop_ids and set(tok.stop_ids) <= set(model.config.eos_token_ids)
    ids = prompt_ids(tok, "Once upon a time")
    engine = ts.Engine(model, num_blocks=16, block_size=16, tokenizer=tok)
    stopped, ran_on = engine.generate([ids, ids], [SamplingParams(max_new_tokens=5),
                                                   SamplingParams(max_new_tokens=5, ignore_eos=True)])
    assert stopped == [end] and ran_on == [end] * 5


# --- chat ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama3", "tinyllama"])
def test_chat_opens_with_one_bos_and_ends_each_turn_at_the_end_token(files, name, capsys, monkeypatch):
    from tinyserve.chat import Conversation
    f, tok = FAMILIES[name], ts.load_tokenizer(files[name])
    check_bos(tok, f, Conversation(tok, "Be brief.").ids)
    rc, out, err = run_cli(capsys, "chat", "--model", str(files[name]), *NUMPY, "--max-new-tokens", "6",
                           stdin="Hi\nAnd again\n/quit\n", monkeypatch=monkeypatch)
    assert rc == 0, err
    turns = [line for line in err.splitlines() if line.startswith("[turn ")]
    assert len(turns) == 2 and all(", 1 tokens in " in t for t in turns), err


# --- serve ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_serve_renders_the_files_template_and_stops_at_its_end_token(files, name):
    from tinyserve.server import ServerThread, build
    f = FAMILIES[name]
    tok = ts.load_tokenizer(files[name])
    args = cli.build_parser().parse_args(["serve", "--model", str(files[name]), *NUMPY, "--num-blocks", "32"])
    app, served = build(args, log=lambda line: None)
    assert served == name                  # the file's name, not the shipped model's
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with ServerThread(app) as srv:
        chat = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": served, "messages": messages, "max_tokens": 6, "temperature": 0}).json()
        plain = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": served, "prompt": "Hello world", "max_tokens": 6, "temperature": 0}).json()
    assert chat["choices"][0]["finish_reason"] == "stop", chat
    assert chat["usage"]["prompt_tokens"] == len(prompt_ids(tok, tok.apply_chat_template(messages)))
    assert chat["usage"]["completion_tokens"] == 1 and chat["choices"][0]["message"]["content"] == ""
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert plain["usage"]["prompt_tokens"] == len(tok.encode("Hello world")) + (f.bos is not None)


# --- bench ---------------------------------------------------------------------------------------------------------

def test_bench_runs_a_gguf(files, capsys):
    rc, out, err = run_cli(capsys, "bench", "--model", str(files["qwen2"]), *NUMPY, "--requests", "2",
                           "--prompt-len", "8", "--output-len", "3", "--sweep", "")
    assert rc == 0, err
    assert "workload: 2 requests" in out and "\nworkload " in out


# --- bad input: one line, a non-zero exit, nothing loaded ----------------------------------------------------------

@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, Path]:
    """A small good file (synthetic 64-token vocabulary) and one broken copy per way a file can be wrong."""
    from tests.test_gguf import _rewrite
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
    out = tmp_path_factory.mktemp("bad")
    shape = replace(SHAPES["smollm2-360m"], dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96, vocab=64,
                    n_layers=1)
    good = out / "good.gguf"
    write_gguf(good, shape, "Q8_0")
    write_gguf(out / "mamba.gguf", replace(shape, arch="mamba"), "Q8_0")

    def iq2(what, x):     # one matrix in a format tinyserve does not read (the byte count of its shape kept right)
        if what == "tensor" and x[0] == "blk.0.ffn_up.weight":
            per, nbytes = GGML_QUANT_SIZES[Q.IQ2_XXS]
            return x[0], np.zeros((24, 4 * 64 // per * nbytes), np.uint8), Q.IQ2_XXS
        return x
    _rewrite(good, out / "iq2.gguf", iq2)
    _rewrite(good, out / "notok.gguf", lambda what, x: None if what == "kv" and x[0].startswith("tokenizer.") else x)
    data = good.read_bytes()
    (out / "cut.gguf").write_bytes(data[:len(data) * 9 // 10])
    (out / "header.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 60)
    (out / "zip.gguf").write_bytes(b"PK\x03\x04" + bytes(60))
    return {p.stem: p for p in out.iterdir()}



@pytest.mark.parametrize("name, says", [
    ("mamba", "architecture 'mamba' is not supported; tinyserve runs llama, qwen2, qwen3, gemma3"),
    ("iq2", "tensor blk.0.ffn_up.weight is IQ2_XXS, a format tinyserve does not read"),
    ("cut", "truncated"),
    ("header", "not a readable GGUF file"),
    ("zip", "not the GGUF magic"),
    ("notok", "has no tokenizer"),
    ("absent", "no such GGUF file"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_bad_file_is_one_line_and_exit_2(bad_files, name, says, command, capsys, monkeypatch):
    """Every door that needs text refuses the file before loading anything: the tokenizer is read first, the
    model's whole header and tensor table are checked before a tensor is dequantized, and serve never starts."""
    import uvicorn
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("serve started on a bad file"))
    path = bad_files.get(name, bad_files["good"].with_name("absent.gguf"))
    argv = [command, "--model", str(path), *NUMPY] + (["--max-new-tokens", "2", "hi"] if command == "generate" else [])
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0] and path.name in lines[0], err


def test_the_good_file_runs(bad_files, capsys):
    """The broken copies fail because of what was broken: the file they were made from answers."""
    rc, out, err = run_cli(capsys, "generate", "--model", str(bad_files["good"]), *NUMPY, "--json",
                           "--max-new-tokens", "2", "tok5 tok7")
    assert rc == 0, err
    assert len(json.loads(out)["output_ids"]) >= 1


def test_a_missing_weights_folder_is_named(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nowhere"), *NUMPY, "hi")
    assert rc == 2 and str(tmp_path / "nowhere") in err and len(err.strip().splitlines()) == 1, err
