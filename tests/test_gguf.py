"""GGUF files of every family: the formats' dequantizer against gguf-py's, clear errors for bad files, and the float
path's logits against transformers loading the same file (tests/fixtures/gguf_reference.*, written by
tools/make_reference.py --gguf; the random-weight files are written again here from their seed, and their sha256
must match the one the fixture recorded)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import tinyserve as ts
from tinyserve import gguf_quants, kv_cache, naive
from tinyserve.gguf_file import FAMILIES, GGUFError, read_gguf, require_tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from make_gguf_fixtures import SHAPES, shrunk, write_gguf  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
REF = json.loads((FIXTURES / "gguf_reference.json").read_text())
ARR = dict(np.load(FIXTURES / "gguf_reference.npz"))
# tests/test_reference.py's bound for SmolLM2 (logits O(10), 30 layers); the random files' logits are O(10) too,
# Gemma's up to ~60, whose float32 rounding is proportionally larger
LOGIT_ATOL = 1e-3


# --- the formats --------------------------------------------------------------------------------------------------

def random_blocks(type_name: str, n_blocks: int, seed: int) -> np.ndarray:
    """Random bytes for n blocks of a format, its float16 scales/minimums replaced by finite values (random bytes
    would be NaN or inf now and then): every bit pattern of the quants is exercised."""
    rng = np.random.default_rng(seed)
    per, nbytes = gguf_quants.BLOCKS[type_name]
    b = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    f16 = lambda: rng.uniform(-2, 2, (n_blocks, 1)).astype(np.float16).view(np.uint8)   # noqa: E731
    halves = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2],
              "Q5_K": [0, 2], "Q6_K": [208]}
    for at in halves.get(type_name, []):
        b[:, at:at + 2] = f16()
    if type_name == "F16":
        b = rng.uniform(-4, 4, n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if type_name == "F32":
        b = rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8).reshape(n_blocks, 4)
    if type_name == "BF16":
        b = (rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        b = b.view(np.uint8).reshape(n_blocks, 2)
    return b.reshape(-1)


@pytest.mark.parametrize("type_name", gguf_quants.SUPPORTED)
def test_dequantize_matches_gguf_py(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as reference
    per = gguf_quants.BLOCKS[type_name][0]
    rows, cols = 3, 512 if per == 256 else 96
    raw = random_blocks(type_name, rows * cols // per, seed=len(type_name))
    ours = gguf_quants.dequantize(raw, type_name, (rows, cols))
    theirs = reference(raw.reshape(rows, -1), GGMLQuantizationType[type_name]).astype(np.float32)
    assert ours.shape == theirs.shape == (rows, cols)
    assert np.array_equal(ours, theirs), f"{type_name}: max diff {np.abs(ours - theirs).max()}"


def test_dequantize_checks_the_byte_count():
    with pytest.raises(ValueError, match="needs 34 bytes"):
        gguf_quants.dequantize(np.zeros(33, np.uint8), "Q8_0", (1, 32))
    with pytest.raises(ValueError, match="whole blocks of 256"):
        gguf_quants.dequantize(np.zeros(144, np.uint8), "Q4_K", (2, 128))


# --- bad files ----------------------------------------------------------------------------------------------------

TINY = shrunk(SHAPES["smollm2-360m"])


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from dataclasses import replace
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, replace(TINY, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96, vocab=64, n_layers=1),
               "Q8_0")
    return path


def test_tiny_gguf_loads(tiny_gguf):
    m = ts.load_model(tiny_gguf)
    assert m.config.arch == "llama" and m.config.dim == 64 and m.config.vocab_size == 64
    assert m.config.eos_token_ids[0] == 2 and m.config.bos_token_id == 1
    assert naive.forward(m, [1, 5, 7]).shape == (3, 64)
    assert read_gguf(tiny_gguf).has_tokenizer


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a GGUF through gguf-py's reader and writer with `edit(name, kv or tensor)` changing what it likes."""
    import gguf
    r = gguf.GGUFReader(str(src))
    arch = edit("arch", r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = edit("kv", (key, f.contents()))
        if value is None:
            continue
        key = key.replace(r.fields["general.architecture"].contents() + ".", arch + ".")
        sub = f.types[-1] if len(f.types) > 1 else None
        w.add_key_value(key, value[1], f.types[0], sub)
    for t in r.tensors:
        name, data, kind = edit("tensor", (t.name, np.asarray(t.data), t.tensor_type))
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_unsupported_architecture(tiny_gguf, tmp_path):
    bad = _rewrite(tiny_gguf, tmp_path / "bad.gguf", lambda what, x: "mamba" if what == "arch" else x)
    with pytest.raises(GGUFError) as e:
        ts.load_model(bad)
    msg = str(e.value)
    assert "'mamba'" in msg and str(bad) in msg and all(a in msg for a in FAMILIES) and "\n" not in msg


def test_unsupported_tensor_type(tiny_gguf, tmp_path):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    def edit(what, x):
        if what == "tensor" and x[0] == "blk.0.ffn_up.weight":
            rows, cols = 96, 64   # IQ2_XXS needs rows of 256: a wider tensor of the right byte count
            per, nbytes = GGML_QUANT_SIZES[Q.IQ2_XXS]
            return x[0], np.zeros((rows // 4, 4 * cols // per * nbytes), np.uint8), Q.IQ2_XXS
        return x
    bad = _rewrite(tiny_gguf, tmp_path / "iq.gguf", edit)
    with pytest.raises(GGUFError, match=r"tensor blk\.0\.ffn_up\.weight is IQ2_XXS, a format tinyserve does not read"):
        ts.load_model(bad)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_truncated_file(tiny_gguf, tmp_path, keep):
    data = tiny_gguf.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(GGUFError, match="truncated") as e:
        ts.load_model(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("garbage", [b"GGUF", b"GGUF" + b"\xff" * 60, b"GGUF\x03\x00\x00\x00" + b"\x00" * 5])
def test_corrupt_header(tmp_path, garbage):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(garbage)
    with pytest.raises(GGUFError, match="truncated or corrupt|architecture None"):
        ts.load_model(bad)


def test_not_a_gguf_and_missing(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        ts.load_model(tmp_path / "x.gguf")
    with pytest.raises(GGUFError, match="no such file"):
        ts.load_model(tmp_path / "absent.gguf")


def test_missing_tensor_and_no_tokenizer(tiny_gguf, tmp_path):
    def drop_norm(what, x):
        if what == "tensor" and x[0] == "blk.0.ffn_norm.weight":
            return "blk.0.unknown.weight", x[1], x[2]
        return x
    bad = _rewrite(tiny_gguf, tmp_path / "norm.gguf", drop_norm)
    with pytest.raises(GGUFError, match=r"tensor blk\.0\.ffn_norm\.weight is missing"):
        ts.load_model(bad)
    no_tok = _rewrite(tiny_gguf, tmp_path / "notok.gguf",
                      lambda what, x: None if what == "kv" and x[0].startswith("tokenizer.") else x)
    assert not read_gguf(no_tok).has_tokenizer
    with pytest.raises(GGUFError, match="no tokenizer in this GGUF"):
        require_tokenizer(no_tok)
    assert ts.load_model(no_tok).config.vocab_size == 64     # the model itself needs no tokenizer


def test_a_family_with_switches_runs_on_the_tiles_through_the_block_forward(tmp_path):
    # Qwen3's Q/K norms are not in the fused LLaMA kernels: the model stays on numba (no fallback message) and runs
    # kernels/block_forward.py (tests/test_block_forward.py holds its logits to the NumPy reference)
    from dataclasses import replace
    from tinyserve import backend
    path = tmp_path / "qwen3.gguf"
    write_gguf(path, replace(shrunk(SHAPES["qwen3-0.6b"]), dim=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn=96,
                             vocab=64, n_layers=1), "F16")
    said = []
    m = ts.load_model(path, quant="auto", backend="numba", log=said.append)
    assert m.backend == "numba" and said == [] and backend.block_switches(m) == ["Q/K norms"]
    assert backend.kernel_gaps(m) == []


# --- transformers on the same files -------------------------------------------------------------------------------

def compare(logits_of_chunks, key: str) -> None:
    """Top-k logits at transformers' top ids and the logsumexp per position, within LOGIT_ATOL."""
    ref_ids, ref_top, ref_lse = ARR[f"{key}/top_ids"], ARR[f"{key}/top_logits"], ARR[f"{key}/lse"]
    errs, lse_errs, top1 = [], [], []
    for start, logits in logits_of_chunks:                                # [c, V] float32
        rows = slice(start, start + len(logits))
        errs.append(np.abs(np.take_along_axis(logits, ref_ids[rows], axis=-1) - ref_top[rows]).max())
        m = logits.max(-1, keepdims=True).astype(np.float64)
        lse = (m[:, 0] + np.log(np.exp(logits - m).sum(-1)))
        lse_errs.append(np.abs(lse - ref_lse[rows]).max())
        clear = ref_top[rows, 0] - ref_top[rows, 1] > 10 * LOGIT_ATOL    # the top-1 is decided (no near-tie)
        top1.append((logits.argmax(-1) == ref_ids[rows, 0])[clear].all())
    print(f"{key}: max abs error top-{ref_ids.shape[1]} {max(errs):.2e}, logsumexp {max(lse_errs):.2e}")
    assert max(errs) < LOGIT_ATOL and max(lse_errs) < LOGIT_ATOL and all(top1)


@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.slow) if k.endswith("Q8_0") else k
                                 for k in REF["files"]])   # one format per family in the quick suite
def test_random_gguf_matches_transformers(tmp_path, key):
    spec = REF["files"][key]
    path = tmp_path / f"{key}.gguf"
    digest = write_gguf(path, shrunk(SHAPES[spec["shape"]]), spec["qtype"], spec["seed"],
                        rope_freqs=spec.get("rope_freqs", False))
    assert digest == spec["sha256"], "tools/make_gguf_fixtures.py writes other bytes than the fixture saw: " \
                                     "run tools/make_reference.py --gguf again"
    model = ts.load_model(path)
    assert model.config.arch == SHAPES[spec["shape"]].arch
    compare([(0, naive.forward(model, spec["ids"]))], key)


def gemma_path() -> Path:
    """The Gemma 3 270M GGUF, found as every real-Gemma test finds it (tests/conftest.py)."""
    from tests.conftest import _gemma_gguf
    return _gemma_gguf()


@pytest.fixture(scope="module")
def gemma():
    return ts.load_model(gemma_path())


@pytest.mark.slow
@pytest.mark.parametrize("name", list((REF["gemma"] or {}).get("passages", {})))
def test_real_gemma_matches_transformers(gemma, name):
    """Teacher-forced through the KV cache in chunks of 128 (the constitution passage crosses the local layers'
    512-token window): the contiguous cache's windowed attention, one chunk's logits at a time."""
    ids = REF["gemma"]["passages"][name]["ids"]
    cache = kv_cache.KVCache.allocate(gemma.config, len(ids))

    def chunks():
        for start in range(0, len(ids), 128):
            yield start, kv_cache.forward_with_cache(gemma, cache, ids[start:start + 128], all_logits=True)
    compare(chunks(), f"gemma/{name}")


@pytest.mark.slow
@pytest.mark.parametrize("key", ["tinyllama-1.1b-F16", "llama-3.2-1b-rope_freqs-F16"])
def test_fast_path_runs_llama_files_of_other_shapes(tmp_path, key):
    """An untied head (TinyLlama) and Llama 3's rope factors on the Numba kernels: the same top-1 as the NumPy
    reference of the same quantisation at every position, and float32's wherever float32 decides clearly (a random
    model has many near-ties, which int8 rounding may flip: ~8 % of these positions, all with margins < 0.5)."""
    from tinyserve.backend import runs_on_kernels
    spec = REF["files"][key]
    path = tmp_path / f"{key}.gguf"
    write_gguf(path, shrunk(SHAPES[spec["shape"]]), spec["qtype"], spec["seed"], rope_freqs=spec.get("rope_freqs", False))
    ref = naive.forward(ts.load_model(path), spec["ids"])                                   # [T, V] float32
    fast_model = ts.load_model(path, quant="w8a8-64", backend="numba")
    assert runs_on_kernels(fast_model)
    fast = naive.forward(fast_model, spec["ids"])
    same_mode = naive.forward(ts.load_model(path, quant="w8a8-64", backend="numpy"), spec["ids"])
    # the NumPy reference's float32 steps go through BLAS, whose summation order is the CPU's (OpenBLAS's Haswell
    # kernel differs from its AVX-512 one): an activation on a rounding boundary then rounds one int8 step the other
    # way and moves a few positions' logits a little. Elsewhere the two agree to float32 rounding, and the top-1
    # wherever the reference decides clearly
    close = np.abs(fast - same_mode).max(axis=-1) < 1e-3
    top2_same = np.sort(same_mode, axis=-1)[:, -2:]
    decided = top2_same[:, 1] - top2_same[:, 0] > 0.5
    assert close.mean() > 0.9 and np.abs(fast - same_mode).max() < 0.5
    assert np.array_equal(fast.argmax(-1)[decided], same_mode.argmax(-1)[decided])
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.5
    assert clear.mean() > 0.5 and np.array_equal(fast.argmax(-1)[clear], ref.argmax(-1)[clear])
