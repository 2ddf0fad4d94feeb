"""load_model(FILE.gguf, quant="gguf") straight from the file's blocks (quant.load_gguf_blocks): no float32 model.

The route before it made the float32 model of the file (gguf_file.load_gguf_model: 4 bytes a parameter, gigabytes
for a 1B model) and took each matrix's blocks from there (`old_route` below keeps it, as the reference). The blocks
route must give the kernels the very same bytes: every packed tile of the fused decode step, the LM head, the
embedding's rows. Checked on a file of every format (with chunks of a few rows, so that a matrix and the
Q6_K head are split across chunks and Q/K heads are unpermuted chunk by chunk), on a shrunk Llama-3.2-1B
shape as make_gguf_fixtures writes it, and on the real SmolLM2's Q4_K_M and Q8_0 files ($TINYSERVE_GGUF_DIR).
"""
from __future__ import annotations

import dataclasses
import os
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import tinyserve as ts
from tinyserve import backend, gguf_file, gguf_quants, naive, quant
from tinyserve.gguf_file import GGUFError, LAYER_TENSORS, TensorRows
from tinyserve.kernels import forward as fast
from tests.test_gguf import SHAPES, _rewrite, shrunk, write_gguf
from tests.test_gguf_tiles import LAYER_FORMATS, random_tensor

GGUF_DIR = os.environ.get("TINYSERVE_GGUF_DIR")


def old_route(path: Path):
    """The gguf mode as load_model built it before the blocks route: the float32 model first, then each matrix's
    blocks split from the whole tensor (Q/K rows unpermuted), or Q8_0's rule on the float32 matrix where the format
    has no exact tile."""
    model = gguf_file.load_gguf_model(path)
    cfg, tensors = model.config, model.gguf_tensors
    heads = {"wq": cfg.n_heads, "wk": cfg.n_kv_heads} if cfg.arch == "llama" else {}
    f16 = lambda a: a.astype(np.float16).astype(np.float32)                             # noqa: E731

    def matrix(info, w, n_heads=None):
        if info.type_name == "Q6_K":                  # the 6-bit tile: Q6_K's own integers and scales
            b = gguf_quants.split_q6_k(info.raw, info.shape)
            parts = [gguf_file.unpermute_rope_rows(a, n_heads) if n_heads else a for a in b]
            return quant.Q6Linear(*(np.ascontiguousarray(a.T) for a in parts), quant.GGUF.name)
        if quant.tile_of(info.type_name).startswith("byte ("):
            return quant.quantize_q8_blocks(w)
        b = gguf_quants.split_blocks(info.raw, info.type_name, info.shape)
        q, d, m = b.q, f16(b.d), f16(b.m)
        if n_heads:
            q, d, m = (gguf_file.unpermute_rope_rows(a, n_heads) for a in (q, d, m))
        q, d, m = (np.ascontiguousarray(a.T) for a in (q, d, m))
        if info.type_name in quant.NIBBLE_FORMATS:    # Q4_0's (m = -8 d throughout): the symmetric tile
            return quant.nibble_linear(q, d, m, quant.GGUF.name)
        if info.type_name in quant.FIVE_BIT_FORMATS:  # Q5_0's (m = -16 d): the 5-bit tile without m
            return quant.five_linear(q, d, m, quant.GGUF.name)
        return quant.byte_linear(q, d, m, quant.GGUF.name)   # Q8_0's (m = -128 d): the byte tile without m
    names = {f: n for n, f in LAYER_TENSORS.items()}
    layers = [dataclasses.replace(w, **{f: matrix(tensors[f"blk.{i}.{names[f]}"], getattr(w, f), heads.get(f))
                                        for f in quant.MATRICES}) for i, w in enumerate(model.layers)]
    layers = quant.settle_roles(layers)           # Q6_K beside other formats in a fused role: on bytes
    head = matrix(tensors["token_embd.weight" if model.output is None else "output.weight"], model.head.T)
    return dataclasses.replace(model, layers=layers, lm_head_q=head, quant=quant.GGUF.name, backend="numba")


def packed_arrays(o, where=""):
    """Every array of a packed-weights structure (NamedTuples, dataclasses, lists), with where it sits."""
    if isinstance(o, np.ndarray):
        yield where, o
    elif isinstance(o, tuple | list):
        for k, v in zip(getattr(o, "_fields", range(len(o))), o):
            yield from packed_arrays(v, f"{where}.{k}")
    elif dataclasses.is_dataclass(o):
        for f in dataclasses.fields(o):
            yield from packed_arrays(getattr(o, f.name), f"{where}.{f.name}")


def assert_blocks_route_is_the_old_route(path: Path) -> None:
    new = ts.load_model(path, quant="gguf", backend="numba")
    old = old_route(path)
    assert new.quant == quant.GGUF.name and isinstance(new.embed, TensorRows)
    for i, (a, b) in enumerate(zip(new.layers, old.layers)):
        for f in quant.MATRICES:
            x, y = getattr(a, f), getattr(b, f)
            fields = [k.name for k in dataclasses.fields(x) if k.name != "mode"]    # q, d, m (Q6_K: q, sc, d)
            assert type(x) is type(y) and all(np.array_equal(getattr(x, k), getattr(y, k)) for k in fields), (i, f)
    got, want = list(packed_arrays(fast.prepare(new))), list(packed_arrays(fast.prepare(old)))
    assert [n for n, _ in got] == [n for n, _ in want] and len(got) > 10
    for (name, x), (_, y) in zip(got, want):      # byte for byte (NaN-proof: compared as bytes)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert np.array_equal(np.ascontiguousarray(x).view(np.uint8), np.ascontiguousarray(y).view(np.uint8)), name
    V = old.config.vocab_size
    rows = np.array([[0, V - 1], [3, 3], [V // 2, 1]])
    assert np.array_equal(new.embed[rows], old.embed[rows]) and new.embed[rows].shape == (3, 2, old.config.dim)
    assert np.array_equal(new.embed[V - 4:], old.embed[V - 4:]) and np.array_equal(new.embed[-1], old.embed[-1])
    assert np.array_equal(new.final_norm, old.final_norm)
    for a, b in zip(new.layers, old.layers):
        assert np.array_equal(a.attn_norm, b.attn_norm) and np.array_equal(a.mlp_norm, b.mlp_norm)


TINY = replace(shrunk(SHAPES["smollm2-360m"]), dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512, vocab=96,
               n_layers=len(LAYER_FORMATS))


@pytest.fixture(scope="module")
def every_format_file(tmp_path_factory) -> Path:
    """A llama GGUF whose matrices are tests/test_gguf_tiles.py's LAYER_FORMATS (every format, mixed within the
    fused roles and across layers), its tied embedding Q6_K: a head on the 6-bit tile."""
    import gguf
    tmp = tmp_path_factory.mktemp("blocks")
    names = {n: f for n, f in LAYER_TENSORS.items()}

    def edit(what, x):
        if what != "tensor":
            return x
        name, data, _ = x
        if name == "token_embd.weight":
            fmt = "Q6_K"
        elif name.startswith("blk.") and names.get(name.split(".", 2)[2]) in quant.MATRICES:
            fmt = LAYER_FORMATS[int(name.split(".")[1])][names[name.split(".", 2)[2]]]
        else:
            return x
        rows, cols = data.shape
        per, nbytes = gguf_quants.BLOCKS[fmt]
        raw = random_tensor(fmt, rows, cols, seed=zlib.crc32(name.encode())).reshape(rows, cols // per * nbytes)
        return name, raw, gguf.GGMLQuantizationType[fmt]
    src = tmp / "f16.gguf"
    write_gguf(src, TINY, "F16")
    return _rewrite(src, tmp / "every-format.gguf", edit)


def test_every_format_packs_the_same_bytes_from_the_blocks(every_format_file, monkeypatch):
    g = gguf_file.read_gguf(every_format_file)
    assert {t.type_name for t in g.tensors.values()} >= set(gguf_quants.SUPPORTED) - {"F32"} | {"Q6_K"}
    assert_blocks_route_is_the_old_route(every_format_file)
    monkeypatch.setattr(quant, "ROWS_PER_CHUNK", 24)   # 64-row matrices in 3 chunks; Q/K in whole heads of 64 rows
    assert_blocks_route_is_the_old_route(every_format_file)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
def test_a_llama_3_2_1b_shape_packs_the_same_bytes(tmp_path, qtype):
    path = tmp_path / f"llama-{qtype}.gguf"
    write_gguf(path, shrunk(SHAPES["llama-3.2-1b"]), qtype, seed=3, rope_freqs=True)
    assert_blocks_route_is_the_old_route(path)


def test_bytes_per_decode_step_are_the_packed_tiles(every_format_file):
    """quant.bytes_per_decode_step counts what the fused decode step reads: its packed weights (a fused role on
    one tile, quant.role_tile), the norms aside."""
    m = ts.load_model(every_format_file, quant="gguf", backend="numba")
    d = fast.prepare(m).decode
    packed = sum(r.w.nbytes for r in (d.layers.qkv, d.layers.o, d.layers.gate_up, d.layers.down, d.lm_head))
    assert quant.bytes_per_decode_step(m) == packed


def test_auto_on_numba_takes_the_blocks_route_and_numpy_keeps_float32(every_format_file):
    m = ts.load_model(every_format_file, quant="auto", backend="numba")
    assert m.quant == quant.GGUF.name and isinstance(m.embed, TensorRows)
    f = ts.load_model(every_format_file, quant="auto", backend="numpy")
    assert f.quant == quant.NONE.name and isinstance(f.embed, np.ndarray)
    ids = [1, 5, 7, 2]           # the NumPy reference of the gguf mode: the same logits by either route
    want = naive.forward(backend.set_backend(gguf_file.load_gguf_model(every_format_file), "gguf", "numpy"), ids)
    got = naive.forward(ts.load_model(every_format_file, quant="gguf", backend="numpy"), ids)
    assert np.array_equal(got, want)


def test_a_corrupt_scale_is_one_line_naming_the_tensor(every_format_file, tmp_path):
    data = bytearray(every_format_file.read_bytes())
    header = gguf_file.read_header(every_format_file)
    offset = dict((n, off) for n, _, _, off in header.tensors)["blk.0.attn_q.weight"]
    at = header.data_start + offset                 # blk.0.attn_q.weight is Q4_0: its first block's d first
    data[at:at + 2] = np.float16(np.inf).tobytes()
    bad = tmp_path / "inf.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"tensor blk\.0\.attn_q\.weight \(Q4_0\): holds NaN or inf") as e:
        ts.load_model(bad, quant="gguf", backend="numba")
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(not GGUF_DIR, reason="set TINYSERVE_GGUF_DIR to the folder of the SmolLM2 GGUFs "
                                         "(docs/your-own-model.md) to check the real files")
@pytest.mark.parametrize("fmt", ["Q4_K_M", "Q8_0"])
def test_the_real_smollm2_files_pack_the_same_bytes(fmt):
    path = Path(GGUF_DIR) / f"SmolLM2-135M-Instruct.{fmt}.gguf"
    assert path.is_file(), f"{path} is missing (TINYSERVE_GGUF_DIR={GGUF_DIR})"
    assert_blocks_route_is_the_old_route(path)
