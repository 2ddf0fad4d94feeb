"""`python -m tinyserve generate` as a user runs it: a subprocess, JSON or streamed text, clean errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinyserve.weights import DEFAULT_WEIGHTS_DIR

ROOT = Path(__file__).resolve().parent.parent
REF = json.loads((Path(__file__).parent / "fixtures" / "reference.json").read_text())
WEIGHTS = os.environ.get("TINYSERVE_WEIGHTS", str(DEFAULT_WEIGHTS_DIR))


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "tinyserve", "generate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.real
def test_generate_json_chat(smol_tok):
    """The float32 reference path, through the chat template, reproduces transformers' greedy answer."""
    p = REF["prompts"]["chat"]
    r = run_cli("--json", "--chat", "--quant", "none", "--backend", "numpy", "--max-new-tokens", "16",
                "--weights", WEIGHTS, p["messages"][0]["content"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"prompt_ids", "output_ids", "text", "ttft_s", "tokens_per_s", "quant", "backend"} <= out.keys()
    assert out["prompt_ids"] == p["ids"]
    eos = p["greedy"].index(smol_tok.eos_id)
    assert out["output_ids"] == p["greedy"][: eos + 1]        # stops on <|im_end|>, which is included
    assert out["text"] == smol_tok.decode(out["output_ids"], skip_special_tokens=True)
    assert (out["quant"], out["backend"]) == ("none", "numpy")
    assert out["ttft_s"] > 0 and (out["tokens_per_s"] is None or out["tokens_per_s"] > 0)   # null, never NaN


@pytest.mark.real
def test_generate_default_is_the_fast_path(smol_tok):
    """Without options, generate runs the fast path (backend.default_quant on the Numba kernels: w4a8 for SmolLM2,
    whose layers are Q4_1, on the variants of backend.W4A8_DEFAULT_ON, w8a8-64 on the others with a byte dot product,
    else int8) and still answers correctly; its token-level agreement with float32 is measured in
    tests/test_quant_accuracy.py, not assumed here.

    The question is one float32 answers with a clear margin at every token ("The capital of Japan is Tokyo.": at
    least 0.97 logits between its top two choices, 2.54 at the first token). The fixture's chat prompt (France)
    opens on a near tie in float32 ("The" 25.33, "L" 25.24): there W4A8 answers "L'Étoile, la Marseillaise, ...",
    and so does llama.cpp on the same 4-bit weights (measured), while float32 says Paris: a coin toss, not a test."""
    from tinyserve import backend
    r = run_cli("--json", "--chat", "--max-new-tokens", "16", "--weights", WEIGHTS, "What is the capital of Japan?")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["quant"], out["backend"]) == (backend.default_quant(), "numba")
    assert out["quant"] in ("int8", "w8a8-64", "w4a8")
    assert "Tokyo" in out["text"] and out["output_ids"][-1] == smol_tok.eos_id


@pytest.mark.real
def test_generate_json_naive_plain_prompt(smol_tok):
    p = REF["prompts"]["english"]
    r = run_cli("--json", "--strategy", "naive", "--quant", "none", "--backend", "numpy", "--max-new-tokens", "4",
                "--weights", WEIGHTS, p["text"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["strategy"] == "naive"
    assert out["prompt_ids"] == p["ids"] and out["output_ids"] == p["greedy"][:4]
    assert out["tokens_per_s"] > 0 and out["total_s"] >= out["ttft_s"] > 0


@pytest.mark.real
def test_generate_streams_text(smol_tok):
    p = REF["prompts"]["english"]
    r = run_cli("--strategy", "naive", "--quant", "none", "--backend", "numpy", "--max-new-tokens", "4",
                "--weights", WEIGHTS, p["text"])
    assert r.returncode == 0, r.stderr
    assert r.stdout == smol_tok.decode(p["greedy"][:4]) + "\n"
    assert "tokens/s" in r.stderr                            # the summary line goes to stderr, not into the text
    assert "float32, numpy backend" in r.stderr              # and says which path ran


def assert_clean_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    for w in words:
        assert w in lines[0]
    assert r.stdout == ""


@pytest.mark.parametrize("args, words", [
    (["--temperature", "-1"], ["temperature"]),
    (["--temperature", "nan"], ["temperature"]),
    (["--top-p", "0"], ["top_p"]),
    (["--top-p", "1.5"], ["top_p"]),
    (["--top-k", "-3"], ["top_k"]),
    (["--min-p", "2"], ["min_p"]),
    (["--repetition-penalty", "0"], ["repetition_penalty"]),
    (["--max-new-tokens", "0"], ["max_new_tokens"]),
    (["--seed", "-1"], ["seed"]),
    (["--stop", ""], ["stop"]),
    (["--strategy", "warp-drive"], ["unknown strategy"]),
])
def test_bad_parameters_exit_2_with_one_line(capsys, args, words):
    # in-process through main() (the same code path as `python -m tinyserve`, without ~2 s of imports per
    # case); parameters are validated before the model loads, so these need no weights
    from tinyserve.__main__ import main
    code = main(["generate", *args, "hello"])
    captured = capsys.readouterr()
    assert_clean_error(subprocess.CompletedProcess([], code, captured.out, captured.err), *words)


def test_bad_parameter_in_a_real_subprocess():
    assert_clean_error(run_cli("--temperature", "-1", "hello", timeout=120), "temperature")


def test_missing_weights_exit_2(tmp_path):
    assert_clean_error(run_cli("--weights", str(tmp_path / "nowhere"), "hello", timeout=120), "make weights")


@pytest.mark.real
def test_empty_prompt_exit_2(smol_tok):
    assert_clean_error(run_cli("--weights", WEIGHTS, ""), "empty")


def test_argparse_errors_exit_2():
    r = run_cli("--temperature", "warm", "hello", timeout=120)   # not a number: argparse's own message
    assert r.returncode == 2 and "Traceback" not in r.stderr and "invalid float value" in r.stderr


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench", "speed"])
def test_model_names_the_weights_and_weights_is_its_alias(command, tmp_path):
    # --model PATH reaches weights.load_model / tokenizer.load_tokenizer unchanged (a folder or a .gguf file);
    # --weights, its old name, fills the same option
    from tinyserve.__main__ import build_parser
    extra = ["hello"] if command == "generate" else []
    path = str(tmp_path / "model.gguf")
    for flag in ("--model", "--weights"):
        args = build_parser().parse_args([command, flag, path, *extra])
        assert args.model == path and not hasattr(args, "weights")
    assert build_parser().parse_args([command, *extra]).model == str(DEFAULT_WEIGHTS_DIR)


def test_model_path_goes_to_the_loaders_unchanged(monkeypatch, tmp_path):
    from tinyserve import cli_options, tokenizer, weights
    from tinyserve.__main__ import build_parser
    seen = []
    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda path: seen.append(("tok", path)))
    monkeypatch.setattr(weights, "load_model", lambda path, **kw: seen.append(("model", path)))
    path = str(tmp_path / "some.gguf")
    cli_options.load_for_cli(build_parser().parse_args(["generate", "--model", path, "hi"]))
    assert seen == [("tok", path), ("model", path)]
