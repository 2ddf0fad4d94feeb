"""Clean exits from the command line: Ctrl-C ends generate, chat and weights with one line and status 130;
a closed stdout exits quietly; --json never prints NaN; unwritable folders are one-line errors; `generate -`
reads the prompt from stdin. Most run main() in-process with the model and tokenizer replaced by stand-ins (they
test the CLI's handling, not the model); two real subprocesses check the signal and the pipe end to end."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import types

import pytest

import tinyserve.__main__ as cli
from tinyserve import generate as generate_mod
from tinyserve import tokenizer as tokenizer_mod
from tinyserve import weights as weights_mod

from .test_cli import ROOT, WEIGHTS


class FakeTokenizer:
    """Characters in, characters out: enough for the CLI's plumbing."""
    eos_id = 2

    def __init__(self):
        self.encoded: list[str] = []

    def encode(self, text):
        self.encoded.append(text)
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages):
        return messages[0]["content"]

    def stream_decoder(self):
        tok = self

        class Stream:
            def push(self, t):
                return tok.decode([t])

            def flush(self):
                return ""
        return Stream()


@pytest.fixture
def fake_generate(monkeypatch):
    """`generate` with a stand-in model: the strategy yields what `tokens` holds, then raises `then` if set."""
    tok = FakeTokenizer()
    plan = {"tokens": [ord("o"), ord("k")], "then": None}

    def strategy(model, ids, max_new_tokens, params, tokenizer):
        yield from plan["tokens"]
        if plan["then"] is not None:
            raise plan["then"]

    monkeypatch.setattr(generate_mod, "strategies", lambda: {"kv": strategy})
    monkeypatch.setattr(tokenizer_mod, "load_tokenizer", lambda path: tok)
    monkeypatch.setattr(weights_mod, "load_model",
                        lambda path, **backend: types.SimpleNamespace(quant="none", backend="numpy"))
    plan["tok"] = tok
    return plan


def test_ctrl_c_in_generate_exits_130_with_one_line(fake_generate, capsys):
    fake_generate["then"] = KeyboardInterrupt()
    assert cli.main(["generate", "hello"]) == 130
    out, err = capsys.readouterr()
    assert out == "ok" and err.strip() == "interrupted" and "Traceback" not in err


def test_ctrl_c_in_weights_and_chat_exits_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "fetch_weights", interrupted)
    assert cli.main(["weights"]) == 130
    from tinyserve import chat
    monkeypatch.setattr(chat, "main", interrupted)   # Ctrl-C at the chat's prompt ends the chat
    assert cli.main(["chat"]) == 130
    assert capsys.readouterr().err.split() == ["interrupted", "interrupted"]


def test_a_closed_stdout_exits_quietly(fake_generate, monkeypatch, capsys):
    class ClosedPipe(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert cli.main(["generate", "hello"]) == 141
    assert capsys.readouterr().err == ""


def test_json_never_prints_nan(fake_generate, capsys):
    fake_generate["tokens"] = [ord("x")]            # one token: there is no decode rate to report
    assert cli.main(["generate", "--json", "hello"]) == 0

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    out = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert out["tokens_per_s"] is None and out["output_ids"] == [ord("x")]


def test_generate_dash_reads_the_prompt_from_stdin(fake_generate, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("a prompt\nover two lines\n"))
    assert cli.main(["generate", "-"]) == 0
    assert fake_generate["tok"].encoded[0] == "a prompt\nover two lines"    # only the final newline goes
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert cli.main(["generate", "-"]) == 2
    assert "stdin was empty" in capsys.readouterr().err


def test_unwritable_weights_dir_or_cache_is_one_line(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert cli.main(["weights", "--dir", str(blocker / "weights")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot write the weights folder") and "--dir" in err[0]
    monkeypatch.setenv("TINYSERVE_CACHE", str(blocker / "cache"))
    assert cli.main(["weights", "--dir", str(tmp_path / "weights")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: cannot write the download cache") and "TINYSERVE_CACHE" in err[-1]
    assert not any(line.startswith("Traceback") for line in err)


# --- end to end: a real process, a real signal, a real pipe --------------------------------------------------

def start_generate(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "tinyserve", "generate", "--weights", WEIGHTS, *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.real
@pytest.mark.slow
def test_ctrl_c_in_a_real_process(smol_tok):
    p = start_generate("--max-new-tokens", "400", "--temperature", "1", "--seed", "0", "Tell me a long story.")
    p.stdout.read(1)                                 # it is streaming: the model is loaded and generating
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130 and err.decode().strip() == "interrupted", err.decode()


@pytest.mark.real
@pytest.mark.slow
def test_a_closed_pipe_in_a_real_process(smol_tok):
    p = start_generate("--max-new-tokens", "400", "--temperature", "1", "--seed", "0", "Tell me a long story.")
    p.stdout.read(1)
    p.stdout.close()                                 # what `| head -c 1` does
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141 and err == "", err
