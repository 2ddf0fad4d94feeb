"""Write random-weight GGUF files at the real shapes of the families tinyserve runs, with gguf-py's GGUFWriter.

    python tools/make_gguf_fixtures.py --out DIR [--full] [--types F16,Q8_0] [--shapes qwen3-0.6b,...]

Each file is what llama.cpp's converter would write for that model (its metadata keys, its tensor names, Q/K rows
of llama files permuted for llama.cpp's RoPE), filled with deterministic random weights (seed per shape). Two uses:

- the tests: `shrunk(shape)` keeps every width of the real model (D, F, heads, H) but few layers and a small
  vocabulary, so a file is a few tens of MB. tests/test_gguf.py writes them again at test time (deterministic:
  the fixture records each file's sha256) and compares tinyserve's float path with the logits transformers
  computed on the same file (tools/make_reference.py --gguf writes tests/fixtures/gguf_reference.*).
- benchmarks: `--full` writes the full shapes (hundreds of MB to GBs, never committed). A full file takes the
  vocabulary of the matching llama.cpp vocab GGUF (`--vocab-dir`: vendor/llama.cpp/models of the llama-cpp-python
  sdist) when given, so `load_tokenizer` works on it too.

F16 and Q8_0 come from gguf-py's quantizer; K-quants and the other formats from llama.cpp's
(`llama_cpp.llama_model_quantize` in .venv-llama): `--requantize Q4_K_M,...` runs it on the F16 file.
Needs only numpy and gguf (the runtime venv).
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's shape as its GGUF metadata states it (config.py's legend)."""
    name: str
    arch: str                 # llama | qwen2 | qwen3 | gemma3
    dim: int                  # D
    n_layers: int             # L
    n_heads: int              # N
    n_kv_heads: int           # K
    ffn: int                  # F
    vocab: int                # V
    head_dim: int             # H
    rope_theta: float
    context: int
    eps: float
    tied: bool = True
    sliding_window: int = 0   # gemma3
    vocab_file: str = ""      # llama.cpp's vocab GGUF with this model's tokenizer (ggml-vocab-*.gguf)


SHAPES = {s.name: s for s in [
    Shape("llama-3.2-1b", "llama", 2048, 16, 32, 8, 8192, 128256, 64, 500000.0, 131072, 1e-5,
          vocab_file="ggml-vocab-llama-bpe.gguf"),
    Shape("qwen2.5-0.5b", "qwen2", 896, 24, 14, 2, 4864, 151936, 64, 1000000.0, 32768, 1e-6,
          vocab_file="ggml-vocab-qwen2.gguf"),
    Shape("qwen3-0.6b", "qwen3", 1024, 28, 16, 8, 3072, 151936, 128, 1000000.0, 40960, 1e-6,
          vocab_file="ggml-vocab-qwen2.gguf"),
    Shape("tinyllama-1.1b", "llama", 2048, 22, 32, 4, 5632, 32000, 64, 10000.0, 2048, 1e-5, tied=False,
          vocab_file="ggml-vocab-llama-spm.gguf"),
    Shape("smollm2-360m", "llama", 960, 32, 15, 5, 2560, 49152, 64, 100000.0, 8192, 1e-5),
    Shape("gemma3-270m", "gemma3", 640, 18, 4, 1, 2048, 262144, 256, 1000000.0, 32768, 1e-6, sliding_window=512),
]}


def shrunk(shape: Shape) -> Shape:
    """The test copy: every width of the real model, few layers, a 1,024-token vocabulary. Gemma keeps 6 layers
    (5 local, 1 global) and a 32-token window so that a passage of a few hundred tokens crosses it."""
    if shape.arch == "gemma3":
        return replace(shape, n_layers=6, vocab=1024, sliding_window=32, vocab_file="")
    return replace(shape, n_layers=1 if shape.dim >= 2048 else 2, vocab=1024, vocab_file="")


# Llama 3's long-context RoPE scaling (its config's rope_scaling: factor 32, low/high frequency factors 1 and 4,
# trained at 8,192 positions): llama.cpp's converter stores the resulting per-frequency divisors as rope_freqs.
def llama3_rope_factors(head_dim: int, theta: float, factor: float = 32.0, low: float = 1.0, high: float = 4.0,
                        original_context: int = 8192) -> np.ndarray:   # [H/2] float32
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    low_wavelen, high_wavelen = original_context / low, original_context / high
    smooth = (original_context / wavelen - low) / (high - low)
    out = np.where(wavelen < high_wavelen, 1.0,
                   np.where(wavelen > low_wavelen, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter for llama files: each head's rows [first half | second half] become interleaved
    (tinyserve.weights.unpermute_rope_rows undoes it)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


ROWS_PER_DRAW = 4096   # rows of a matrix drawn at a time: the same numbers as one draw (the generator fills values in
#                        order), without a float64 copy of a 128k-row embedding (2 GB) at once


def tensor_specs(shape: Shape, seed: int = 0, rope_freqs: bool = False):
    """(llama.cpp tensor name, [out, in] shape, make) per tensor, in the file's order; make() -> the float32 array,
    Hugging Face row order (Q/K permuted for llama files). The makes draw from one generator and must be called in
    order, once each: a writer holds one tensor at a time. Weights scaled so activations stay O(1) through the
    layers and the logits are peaked (a random model's next-token guesses are not flat)."""
    rng = np.random.default_rng(seed)
    D, F, H, N, K, V = shape.dim, shape.ffn, shape.head_dim, shape.n_heads, shape.n_kv_heads, shape.vocab

    def mat(n_out, n_in, gain=1.0, heads=None):
        def make():
            out = np.empty((n_out, n_in), np.float32)
            for r0 in range(0, n_out, ROWS_PER_DRAW):
                r1 = min(n_out, r0 + ROWS_PER_DRAW)
                out[r0:r1] = rng.standard_normal((r1 - r0, n_in)) * (gain / np.sqrt(n_in))
            return out if heads is None else permute_rope_rows(out, heads)
        return (n_out, n_in), make

    def norm(n):   # Gemma's files store 1 + w (llama.cpp's converter adds the 1): either way a weight near 1
        return (n,), lambda: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # embedding rows of norm ~3: logits O(10), as a trained model's (Gemma scales them by sqrt(D) itself)
    t = {"token_embd.weight": mat(V, D, 3.0), "output_norm.weight": norm(D)}
    if not shape.tied:
        t["output.weight"] = mat(V, D, 4.0)
    if rope_freqs:
        t["rope_freqs.weight"] = (H // 2,), lambda: llama3_rope_factors(H, shape.rope_theta)
    rope = shape.arch == "llama"
    for i in range(shape.n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"], t[p + "ffn_norm.weight"] = norm(D), norm(D)
        t[p + "attn_q.weight"] = mat(N * H, D, 2.0, N if rope else None)
        t[p + "attn_k.weight"] = mat(K * H, D, 2.0, K if rope else None)
        t[p + "attn_v.weight"], t[p + "attn_output.weight"] = mat(K * H, D), mat(D, N * H, 4.0)
        t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"] = mat(F, D), mat(F, D)
        t[p + "ffn_down.weight"] = mat(D, F, 4.0)
        if shape.arch == "qwen2":
            for n, rows in (("q", N * H), ("k", K * H), ("v", K * H)):
                t[p + f"attn_{n}.bias"] = (rows,), (lambda rows=rows: (0.5 * rng.standard_normal(rows))
                                                    .astype(np.float32))
        if shape.arch in ("qwen3", "gemma3"):
            t[p + "attn_q_norm.weight"], t[p + "attn_k_norm.weight"] = norm(H), norm(H)
        if shape.arch == "gemma3":
            t[p + "post_attention_norm.weight"], t[p + "post_ffw_norm.weight"] = norm(D), norm(D)
    return [(name, dims, make) for name, (dims, make) in t.items()]


def random_tensors(shape: Shape, seed: int = 0, rope_freqs: bool = False) -> dict[str, np.ndarray]:
    """llama.cpp tensor names -> float32 arrays [out, in], every tensor of tensor_specs made (a shrunk shape's)."""
    return {name: make() for name, _, make in tensor_specs(shape, seed, rope_freqs)}


def answering_tensors(t: dict[str, np.ndarray], answer: int) -> dict[str, np.ndarray]:
    """The same tensors turned into a model whose greedy next token is always `answer`, whatever the prompt: the
    blocks add nothing to the residual stream (attn_output and ffn_down are zero), every embedding row is a constant
    vector, and the LM head's row `answer` is twice the others, so its logit is twice theirs after the final norm.
    The tests of stop tokens and BOS need a model that emits a chosen token, not weights that were trained."""
    t = dict(t)
    V, D = t["token_embd.weight"].shape
    head = np.ones((V, D), np.float32)
    head[answer] = 2.0
    t["token_embd.weight"] = head if "output.weight" not in t else np.ones((V, D), np.float32)
    if "output.weight" in t:
        t["output.weight"] = head
    t["output_norm.weight"] = np.ones(D, np.float32)
    for name in t:
        if name.endswith(("attn_output.weight", "ffn_down.weight")):
            t[name] = np.zeros_like(t[name])
    return t


def _add_vocab(w, shape: Shape, vocab_dir: Path | None, skip: tuple[str, ...] = ()) -> None:
    import gguf
    if shape.vocab_file and vocab_dir is not None:   # every tokenizer.* key of llama.cpp's vocab file, as it is
        r = gguf.GGUFReader(str(vocab_dir / shape.vocab_file))
        n = len(r.fields["tokenizer.ggml.tokens"].data)
        if n != shape.vocab:
            raise ValueError(f"{shape.vocab_file} has {n} tokens, the {shape.name} shape {shape.vocab}")
        for key, f in r.fields.items():
            if key.startswith("tokenizer.") and key not in skip:
                array = f.types[0] == gguf.GGUFValueType.ARRAY
                w.add_key_value(key, f.contents(), f.types[0], f.types[1] if array else None)
        return
    # a synthetic vocabulary: three specials, then placeholder pieces (the tests feed token ids, not text)
    tokens = ["<unk>", "<s>", "</s>"] + [f"tok{i}" for i in range(3, shape.vocab)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * shape.vocab)
    w.add_token_types([2, 3, 3] + [1] * (shape.vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_gguf(path: str | Path, shape: Shape, qtype: str = "F16", seed: int = 0, rope_freqs: bool = False,
               vocab_dir: Path | None = None, chat_template: str | None = None, answer: int | None = None) -> str:
    """Write one random-weight GGUF; return its sha256. Norms, biases and rope_freqs stay F32 (as llama.cpp's
    converter keeps every 1-D tensor); matrices and the embedding are `qtype` (F32, F16 or Q8_0).
    `chat_template`: stored as tokenizer.chat_template (the vocab GGUFs carry none); `answer`: a token id the
    model then always predicts greedily (answering_tensors), for the tests of stop tokens and BOS."""
    import gguf
    from gguf.quants import quantize

    kind = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"random {shape.name}")
    w.add_block_count(shape.n_layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.dim)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.eps)
    if shape.head_dim != shape.dim // shape.n_heads or shape.arch in ("qwen3", "gemma3"):
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    if shape.arch == "llama":
        w.add_vocab_size(shape.vocab)
        w.add_rope_dimension_count(shape.head_dim)
    if shape.sliding_window:
        w.add_sliding_window(shape.sliding_window)
    w.add_file_type({"F32": 0, "F16": 1, "Q8_0": 7}[qtype])
    _add_vocab(w, shape, vocab_dir, skip=("tokenizer.chat_template",) if chat_template is not None else ())
    if chat_template is not None:
        w.add_chat_template(chat_template)
    specs = tensor_specs(shape, seed, rope_freqs)
    if answer is not None:
        specs = [(n, a.shape, lambda a=a: a) for n, a in answering_tensors(random_tensors(shape, seed, rope_freqs),
                                                                           answer).items()]

    def stored(dims: tuple, a: np.ndarray | None = None):   # -> (dtype, byte shape, the array as written)
        if len(dims) == 1 or kind == gguf.GGMLQuantizationType.F32:
            return np.float32, dims, a
        if kind == gguf.GGMLQuantizationType.F16:
            return np.float16, dims, None if a is None else a.astype(np.float16)
        per, nbytes = gguf.GGML_QUANT_SIZES[kind]
        return np.uint8, (dims[0], dims[1] // per * nbytes), None if a is None else quantize(a, kind)
    # the tensor table first (shapes and types only), then each tensor made, written and dropped in turn: the
    # writer never holds more than one (a full shape's would be gigabytes in float32)
    for name, dims, _ in specs:
        dtype, byte_dims, _ = stored(dims)
        w.add_tensor_info(name, byte_dims, np.dtype(dtype), int(np.prod(byte_dims)) * np.dtype(dtype).itemsize,
                          raw_dtype=None if dtype is not np.uint8 else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, dims, make in specs:
        w.write_tensor_data(stored(dims, make())[2])
    w.close()
    return sha256(path)


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def requantize(src: Path, dst: Path, ftype: str) -> None:
    """llama.cpp's own quantizer (llama-cpp-python, .venv-llama): F16 -> Q4_K_M, Q5_K_M, Q6_K, Q4_0, ..."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) failed: {rc}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--full", action="store_true", help="full shapes (benchmarks) instead of the shrunk test copies")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--types", default="F16,Q8_0")
    ap.add_argument("--requantize", default="", help="llama.cpp ftypes made from the F16 file, e.g. Q4_K_M,Q4_0")
    ap.add_argument("--vocab-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes.split(","):
        shape = SHAPES[name] if args.full else shrunk(SHAPES[name])
        for qtype in args.types.split(","):
            path = args.out / f"{name}{'' if args.full else '-test'}-{qtype}.gguf"
            digest = write_gguf(path, shape, qtype, vocab_dir=args.vocab_dir)
            print(f"{path} {path.stat().st_size / 2**20:.1f} MiB sha256 {digest[:16]}", file=sys.stderr)
        for ftype in filter(None, args.requantize.split(",")):
            src = args.out / f"{name}{'' if args.full else '-test'}-F16.gguf"
            dst = src.with_name(src.name.replace("-F16", f"-{ftype}"))
            requantize(src, dst, ftype)
            print(f"{dst} {dst.stat().st_size / 2**20:.1f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
