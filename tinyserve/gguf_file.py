"""Read any GGUF file of the families tinyserve runs (llama, qwen2, qwen3, gemma3) into a float32 Model.

A GGUF holds its hyper-parameters as metadata (`<arch>.embedding_length`, `<arch>.attention.head_count`, ...),
the tokenizer's vocabulary, and the tensors in llama.cpp's names (`blk.3.attn_q.weight`), each in its own format
(gguf_quants.py dequantizes them). What the families differ in is a handful of ModelConfig switches:

    arch     switches (every other one LLaMA's default)
    llama    -                                   Llama 2/3.x, TinyLlama, SmolLM2, Mistral
    qwen2    qkv_bias                            Qwen2, Qwen2.5
    qwen3    qk_norm, key_length                 Qwen3
    gemma3   qk_norm, post_norms, gelu_tanh, embed_scale sqrt(D), key_length, sliding window 5 of 6 layers,
             local RoPE base 10,000

`read_gguf(path)` parses and checks the whole file before any tensor is dequantized, so a bad file fails with one
line naming what and where, and nothing is half-loaded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .gguf_quants import BLOCKS, SUPPORTED, dequantize
from .model import LayerWeights, Model

GGUF_MAGIC = b"GGUF"

# arch -> what its block does beyond LLaMA's (ModelConfig field -> value). Gemma 3's window pattern and local RoPE
# base are not in its GGUF metadata: llama.cpp hard-codes them for the architecture, and so do we.
FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma3": {"qk_norm": True, "post_norms": True, "activation": "gelu_tanh", "sliding_window_pattern": 6,
               "rope_theta_local": 10000.0},
}
SUPPORTED_ARCHS = tuple(FAMILIES)

# llama.cpp's tensor names inside block i -> LayerWeights field. Matrices are stored [out, in]; we keep [in, out].
LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_output.weight": "wo", "ffn_norm.weight": "mlp_norm", "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
    "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_mlp_norm",
}
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
OPTIONAL = {"qkv_bias": ("q_bias", "k_bias", "v_bias"), "qk_norm": ("q_norm", "k_norm"),
            "post_norms": ("post_attn_norm", "post_mlp_norm")}   # switch -> the fields it needs in every layer
# llama.cpp ends a generation at any token spelled like one of these, not only at EOS (llama-vocab.cpp,
# special_eog_ids: a Llama 3 file names <|end_of_text|> as EOS, its chat turns end with <|eot_id|>), and treats such
# a token as a control token whatever type the file gives it
END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                     "<|end_of_text|>", "<EOT>", "_<EOT>", "<end_of_utterance>", "</s>", "<eos>")


class WeightsError(RuntimeError):
    """Weights are missing, corrupt, or could not be fetched. The message says what to do. (weights.py exports it:
    it lives here, the lower of the two modules, so that both can raise it.)"""


class GGUFError(WeightsError):
    """A GGUF file tinyserve cannot run: the message names the file and what is wrong."""


@dataclass(slots=True)
class TensorInfo:
    name: str
    type_name: str            # GGML type: F32, Q4_K, ...
    shape: tuple[int, ...]    # NumPy order: [rows, row length] (GGUF lists ne[0], the row length, first)
    raw: np.ndarray           # the bytes, a view into the memory-mapped file


@dataclass(slots=True)
class GGUFFile:
    path: Path
    arch: str
    config: ModelConfig
    metadata: dict            # key -> value (tokenizer arrays left out: gguf_tokenizer reads them)
    tensors: dict[str, TensorInfo]
    has_tokenizer: bool       # the file holds a vocabulary (tokenizer.ggml.tokens)


def require_tokenizer(path: str | Path) -> GGUFFile:
    """The parsed file, or a GGUFError if it holds no vocabulary: generating text needs one (the model does not)."""
    g = read_gguf(path)
    if not g.has_tokenizer:
        raise GGUFError(f"{g.path}: no tokenizer in this GGUF (no tokenizer.ggml.tokens): tinyserve can run its "
                        f"model on token ids, but cannot turn text into ids for it")
    return g


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. [n_heads*H, D] -> same shape.

    llama.cpp rotates neighbouring pairs (2i, 2i+1); Hugging Face rotates (i, i + H/2). Its converter
    reorders the rows of each head from [first half | second half] to interleaved, so we interleave back.
    """
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def is_gguf(path: str | Path) -> bool:
    """A file that starts with GGUF's magic bytes (whatever its name)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            return p.is_file() and f.read(4) == GGUF_MAGIC
    except OSError:
        return False


# GGUF's value types: the scalars' struct formats; 8 is a string, 9 an array (element type, count, elements)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(slots=True)
class Header:
    """A GGUF's header: its key/value metadata and its tensor table (the tensors' bytes follow at data_start)."""
    meta: dict                                        # key -> int | float | bool | str | list
    tensors: list[tuple[str, tuple[int, ...], int, int]]   # (name, shape [rows, row length], GGML type id, offset)
    data_start: int                                   # byte offset of the tensor data (aligned)


def read_header(path: str | Path) -> Header:
    """Parse a GGUF's header in one pass over a memory map. gguf-py's GGUFReader builds an object per array
    element, which takes seconds for a 128k-token vocabulary; the header is a flat sequence of (key, type, value),
    then (name, dims, type, offset) per tensor. Raises ValueError, struct.error or OSError on a bad file."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != GGUF_MAGIC:
            raise ValueError(f"starts with {bytes(m[:4])!r}, not the GGUF magic")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (tinyserve reads versions 2 and 3)")
        if n_kv > len(m) or n_tensors > len(m):
            raise ValueError(f"the header counts {n_kv} keys and {n_tensors} tensors in a file of {len(m)} bytes")
        pos = 24

        def unpack(fmt: str):
            nonlocal pos
            out = struct.unpack_from(fmt, m, pos)
            pos += struct.calcsize(fmt)
            return out

        def string() -> str:
            nonlocal pos
            (n,) = unpack("<Q")
            if pos + n > len(m):
                raise ValueError(f"a string of {n} bytes at offset {pos} runs past the end of the file")
            pos += n
            return m[pos - n:pos].decode("utf-8", errors="replace")

        def value(vtype: int):
            if vtype == _STRING:
                return string()
            if vtype == _ARRAY:
                etype, n = unpack("<IQ")
                if etype in _SCALAR:
                    if pos + n * struct.calcsize(_SCALAR[etype]) > len(m):
                        raise ValueError(f"an array of {n} values at offset {pos} runs past the end of the file")
                    return list(unpack(f"<{n}{_SCALAR[etype][1]}"))
                if n > len(m) - pos:
                    raise ValueError(f"an array of {n} values at offset {pos} runs past the end of the file")
                return [value(etype) for _ in range(n)]
            if vtype not in _SCALAR:
                raise ValueError(f"unknown value type {vtype} at offset {pos}")
            return unpack(_SCALAR[vtype])[0]

        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(unpack("<I")[0])
        tensors = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = unpack("<I")
            if n_dims > 4:
                raise ValueError(f"tensor {name} has {n_dims} dimensions (GGUF has at most 4)")
            dims = unpack(f"<{n_dims}Q")                    # ne[0] (the row length) first
            kind, offset = unpack("<IQ")
            tensors.append((name, tuple(int(d) for d in reversed(dims)), kind, offset))
        align = int(meta.get("general.alignment", 32))
        return Header(meta, tensors, -(-pos // align) * align)


def _type_name(kind: int) -> str:
    from gguf import GGMLQuantizationType
    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF's metadata and tensor table and check that tinyserve can run it (no tensor dequantized yet)."""
    import struct

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    if not is_gguf(path):
        raise GGUFError(f"{path}: not a GGUF file (it does not start with the bytes 'GGUF')")
    try:
        header = read_header(path)
    except (ValueError, struct.error, OverflowError, OSError) as e:
        raise GGUFError(f"{path}: truncated or corrupt GGUF ({type(e).__name__}: {e})") from None
    full = header.meta
    meta = {k: v for k, v in full.items() if not (k.startswith("tokenizer.ggml.") and isinstance(v, list))}
    arch = meta.get("general.architecture")
    if arch not in FAMILIES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported; tinyserve runs {', '.join(SUPPORTED_ARCHS)}")
    size = path.stat().st_size
    data = np.memmap(path, dtype=np.uint8, mode="r") if header.tensors else None
    tensors = {}
    for name, shape, kind, offset in header.tensors:
        type_name = _type_name(kind)
        if type_name not in BLOCKS:
            raise GGUFError(f"{path}: tensor {name} is {type_name}, a format tinyserve does not read "
                            f"(it reads {', '.join(SUPPORTED)})")
        per_block, nbytes = BLOCKS[type_name]
        n = int(np.prod(shape))
        if n % per_block:
            raise GGUFError(f"{path}: corrupt: tensor {name} ({type_name}, shape {shape}) is not whole blocks of "
                            f"{per_block}")
        start, need = header.data_start + offset, n // per_block * nbytes
        if start + need > size:
            raise GGUFError(f"{path}: truncated: tensor {name} needs bytes up to {start + need}, the file has {size}")
        tensors[name] = TensorInfo(name, type_name, shape, data[start:start + need])
    tokens = full.get("tokenizer.ggml.tokens")
    has_tokenizer = isinstance(tokens, list)
    config = config_from_gguf(meta, tensors, path, end_of_generation_ids(tokens if has_tokenizer else []))
    return GGUFFile(path, arch, config, meta, tensors, has_tokenizer)


def config_from_gguf(meta: dict, tensors: dict[str, TensorInfo], path: Path,
                     end_of_generation: list[int] = ()) -> ModelConfig:
    arch = meta["general.architecture"]

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata {arch}.{key} is missing")
        return value

    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: tensor token_embd.weight is missing")
    dim, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    key_length = meta.get(f"{arch}.attention.key_length")
    key_length = None if key_length is None or int(key_length) == dim // n_heads else int(key_length)
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):   # a per-layer list (some files): every layer must agree for our one K
        if len(set(n_kv)) != 1:
            raise GGUFError(f"{path}: per-layer K/V head counts {sorted(set(n_kv))} are not supported")
        n_kv = n_kv[0]
    bos = int(meta.get("tokenizer.ggml.bos_token_id", 1))
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.eom_token_id") if k in meta]
    eos += list(end_of_generation)
    family = dict(FAMILIES[arch])
    if arch == "gemma3":
        family["embed_scale"] = math.sqrt(dim)
        family["sliding_window"] = int(get("attention.sliding_window"))
    try:
        return ModelConfig(
            dim=dim, n_layers=int(get("block_count")), n_heads=n_heads, n_kv_heads=int(n_kv),
            intermediate_size=int(get("feed_forward_length")), vocab_size=tensors["token_embd.weight"].shape[0],
            max_seq_len=int(get("context_length")), rope_theta=float(get("rope.freq_base", 10000.0)),
            norm_eps=float(np.float32(get("attention.layer_norm_rms_epsilon"))), bos_token_id=bos,
            eos_token_ids=tuple(dict.fromkeys(eos)) or (2,), arch=arch, key_length=key_length,
            tied_embeddings="output.weight" not in tensors, **family)
    except ValueError as e:
        raise GGUFError(f"{path}: {e}") from None


def end_of_generation_ids(tokens: list[str]) -> list[int]:
    """Ids of the tokens that end a generation (END_OF_GENERATION) in a GGUF's vocabulary: the config's stop ids
    are the tokenizer's (Tokenizer.stop_ids), as llama.cpp's llama_vocab_is_eog decides them."""
    wanted = set(END_OF_GENERATION)
    return [i for i, t in enumerate(tokens) if t in wanted]


def load_gguf_model(path: str | Path) -> Model:
    """The float32 reference Model of a GGUF file: every tensor dequantized, Q/K rows of llama files unpermuted."""
    return model_from_gguf(read_gguf(path))


@dataclass(slots=True)
class TensorRows:
    """A [V, D] table left in the file's format, read a row at a time: `rows[tokens]` dequantizes only those rows
    ([*tokens.shape, D] float32, the values dequantize gives the whole table). The embedding of a model loaded
    from its blocks: a lookup reads T rows, and a float32 copy of a 128k-token table is a gigabyte."""
    info: TensorInfo
    dtype = np.dtype(np.float32)

    @property
    def shape(self) -> tuple[int, int]:
        return self.info.shape

    @property
    def size(self) -> int:
        return self.info.shape[0] * self.info.shape[1]

    @property
    def ndim(self) -> int:
        return 2

    def __getitem__(self, rows) -> np.ndarray:   # rows: ids [*S] (or a slice) -> [*S, D] float32
        V, D = self.info.shape
        ids = np.asarray(rows)
        if not np.issubdtype(ids.dtype, np.integer):   # a slice or a mask: the ids it picks
            ids = np.arange(V)[rows]
        per_block, nbytes = BLOCKS[self.info.type_name]
        raw = self.info.raw.reshape(V, D // per_block * nbytes)[ids.reshape(-1)]     # [n, row bytes]: a copy
        return dequantize(raw, self.info.type_name, (ids.size, D)).reshape(*ids.shape, D)


def model_from_gguf(g: GGUFFile, matrix=None) -> Model:
    """The Model of a parsed GGUF, every tensor checked (present, of the shape the metadata implies, none unused).

    matrix None: the float32 reference, every tensor dequantized. matrix(info, unpermute_heads) -> a [D_in, O]
    weight object: every layer matrix is what it returns for the file's tensor (quant.load_gguf_blocks passes
    quant.file_matrix, the file's own blocks), the embedding (and an untied output) stays in the file
    (TensorRows), and only the norms and rope_freqs are dequantized: the model never exists in float32."""
    cfg, path = g.config, g.path
    D, F, H, N, K = cfg.dim, cfg.intermediate_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    shapes = {"attn_norm": (D,), "mlp_norm": (D,), "wq": (N * H, D), "wk": (K * H, D), "wv": (K * H, D),
              "wo": (D, N * H), "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F), "q_bias": (N * H,),
              "k_bias": (K * H,), "v_bias": (K * H,), "q_norm": (H,), "k_norm": (H,), "post_attn_norm": (D,),
              "post_mlp_norm": (D,)}
    wanted = [f for f in shapes if not any(f in fs for fs in OPTIONAL.values())]
    wanted += [f for switch, fs in OPTIONAL.items() if getattr(cfg, switch) for f in fs]
    names = {f: n for n, f in LAYER_TENSORS.items()}
    used: set[str] = set()

    def checked(name: str, shape: tuple) -> TensorInfo:
        info = g.tensors.get(name)
        if info is None:
            raise GGUFError(f"{path}: tensor {name} is missing (a {g.arch} model of {cfg.n_layers} layers needs it)")
        if info.shape != shape:
            raise GGUFError(f"{path}: tensor {name} has shape {info.shape}, the metadata implies {shape}")
        used.add(name)
        return info

    def tensor(name: str, shape: tuple) -> np.ndarray:   # [shape] float32, checked
        info = checked(name, shape)
        try:
            w = dequantize(info.raw, info.type_name, info.shape)
        except ValueError as e:
            raise GGUFError(f"{path}: tensor {name}: {e}") from None
        if not np.isfinite(w).all():
            raise GGUFError(f"{path}: tensor {name} ({info.type_name}) holds NaN or inf values: corrupt file")
        return w

    def blocks(name: str, shape: tuple, heads: int | None):   # [D_in, O] from the file's blocks, checked
        info = checked(name, shape)
        try:
            return matrix(info, heads)
        except ValueError as e:
            raise GGUFError(f"{path}: tensor {name} ({info.type_name}): {e}") from None

    rope_heads = {"wq": N, "wk": K} if cfg.arch == "llama" else {}   # llama.cpp's converter interleaves the Q/K
    #                                          rows of llama files only (NEOX RoPE families keep Hugging Face's order)

    layers = []
    for i in range(cfg.n_layers):
        if matrix is not None:
            w = {f: (blocks(f"blk.{i}.{names[f]}", shapes[f], rope_heads.get(f)) if f in MATRICES else
                     tensor(f"blk.{i}.{names[f]}", shapes[f])) for f in wanted}
        else:
            w = {f: tensor(f"blk.{i}.{names[f]}", shapes[f]) for f in wanted}
            for f, heads in rope_heads.items():
                w[f] = unpermute_rope_rows(w[f], heads)
            for f in MATRICES:
                w[f] = np.ascontiguousarray(w[f].T)    # [out, in] -> [in, out]: y = x @ W
        layers.append(LayerWeights(**w))
    table = tensor if matrix is None else lambda name, shape: TensorRows(checked(name, shape))
    embed = table("token_embd.weight", (cfg.vocab_size, D))
    final_norm = tensor("output_norm.weight", (D,))
    output = None if cfg.tied_embeddings else table("output.weight", (cfg.vocab_size, D))
    factors = tensor("rope_freqs.weight", (H // 2,)) if "rope_freqs.weight" in g.tensors else None
    extra = sorted(set(g.tensors) - used)
    if extra:   # a tensor the forward would silently skip: a switch this file needs that we do not know
        raise GGUFError(f"{path}: tensor {extra[0]} (and {len(extra) - 1} more) is not used by tinyserve's "
                        f"{g.arch} block: this file's model differs from the families tinyserve knows")
    model = Model.from_weights(cfg, embed, layers, final_norm, output=output, rope_factors=factors)
    model.gguf_tensors = g.tensors        # the blocks themselves, for quant="gguf" (views into the mapped file)
    return model
