"""llama.cpp's own test files, taken from the llama-cpp-python 0.3.36 sdist (the release the peers pin).

The sdist vendors llama.cpp, whose `models/` folder holds tokenizer-only GGUFs (`ggml-vocab-NAME.gguf`, 0.7-8 MB
each, 17 MB for the five used here) with llama.cpp's encode cases beside them (`.inp`: texts separated by
`__ggml_vocab_test__` lines; `.out`: one line of token ids per text). Too large to commit, so the sdist is fetched
once with pip into tinyserve's cache (or taken from $TINYSERVE_LLAMA_SDIST, a local copy), its sha256 checked, and
the few members used are extracted beside it. llama.cpp is MIT-licensed (its LICENSE is extracted with them).
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from tinyserve.weights import _sha256, cache_dir   # the one file hash the downloads use

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
VOCABS = ("llama-bpe", "llama-spm", "qwen2", "gpt-2", "phi-3")
SEPARATOR = "\n__ggml_vocab_test__\n"


def sdist() -> Path:
    """The sdist in the cache, copied from $TINYSERVE_LLAMA_SDIST or downloaded by pip if absent."""
    path = cache_dir() / SDIST
    if path.exists() and _sha256(path) == SDIST_SHA256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    local = os.environ.get("TINYSERVE_LLAMA_SDIST")
    if local:
        shutil.copyfile(local, path)
    else:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               "-d", str(path.parent), f"llama-cpp-python=={VERSION}"]
        result = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
        if result.returncode != 0 or not path.exists():
            raise RuntimeError(f"could not download llama-cpp-python=={VERSION}'s sdist with pip (set "
                               f"TINYSERVE_LLAMA_SDIST to a local copy): {result.stderr.strip()[-500:]}")
    if _sha256(path) != SDIST_SHA256:
        path.unlink()
        raise RuntimeError(f"{SDIST} does not have the pinned sha256; deleted it")
    return path


def llama_cpp_dir() -> Path:
    """A folder holding llama.cpp's LICENSE and models/ggml-vocab-{VOCABS}.gguf(.inp/.out), extracted once."""
    out = cache_dir() / f"llama-cpp-{VERSION}-files"
    done = out / ".complete"
    if done.exists():
        return out
    wanted = {LLAMA_CPP + "LICENSE"} | {LLAMA_CPP + f"models/ggml-vocab-{v}.gguf{ext}"
                                         for v in VOCABS for ext in ("", ".inp", ".out")}
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist()) as tar:
        for member in tar:
            if member.name in wanted:
                target = tmp / member.name[len(LLAMA_CPP):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
                wanted.discard(member.name)
    if wanted:
        raise RuntimeError(f"{SDIST} lacks {sorted(wanted)}")
    (tmp / ".complete").touch()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def vocab_gguf(name: str) -> Path:
    return llama_cpp_dir() / "models" / f"ggml-vocab-{name}.gguf"


@functools.cache
def vocab_tokenizer(name: str):
    """tinyserve's Tokenizer of one vocabulary GGUF, built once per test session (up to a second each)."""
    from tinyserve.tokenizer import load_tokenizer
    return load_tokenizer(vocab_gguf(name))


def vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's (text, token ids) cases for one vocabulary, parsed as its tests/test-tokenizer-0.cpp does."""
    path = vocab_gguf(name)
    raw = path.with_name(path.name + ".inp").read_bytes().decode("utf-8")
    texts = raw.split(SEPARATOR)
    if texts and texts[-1] == "":     # the file ends with a separator line
        texts.pop()
    lines = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    ids = [[int(t) for t in line.split()] for line in lines[:len(texts)]]
    assert len(ids) == len(texts), f"{path}: {len(texts)} texts but {len(ids)} lines of ids"
    return list(zip(texts, ids))
