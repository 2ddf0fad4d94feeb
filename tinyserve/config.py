"""The model's hyper-parameters, and the one shape notation used across tinyserve.

Symbol legend (every array in the package is annotated with these):

    L  layers                    D  hidden size (model dim)
    F  MLP intermediate size     H  head_dim (D // N unless the file sets it: Qwen3, Gemma 3)
    N  query heads               K  key/value heads (N % K == 0; g = N // K is the group size)
    V  vocabulary size           T  tokens in one forward (all sequences of a batch, flattened)
    B  sequences in a batch      m  new positions of one sequence in this step
    S0 positions already in a sequence's KV cache (its history)
    S  positions one step attends to: S0 history + the m new ones (prefill without history: S = m)
    S_max  positions a KV cache is allocated for     P  positions in a RoPE table (max_pos)
    R  rows that need logits (`logit_rows`; often one per sequence)     bs  block size of the paged KV cache
"""
from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, field
from pathlib import Path


def is_int(x) -> bool:
    """A Python or NumPy integer, but not a bool (True is an int to Python, never a count to us)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_positive_int(name: str, value, what: str = "") -> int:
    """`value` as an int if it is an integer >= 1, else a ValueError naming `name` (prefixed by `what: `)."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{what + ': ' if what else ''}{name} must be an integer >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    dim: int                     # D
    n_layers: int                # L
    n_heads: int                 # N
    n_kv_heads: int              # K
    intermediate_size: int       # F
    vocab_size: int              # V
    max_seq_len: int = 8192      # the context window the model was trained for
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    bos_token_id: int = 1
    eos_token_ids: tuple[int, ...] = field(default=(2,))
    # --- what differs between the model families: every default is LLaMA's, so a SmolLM2 config sets none ---
    arch: str = "llama"                   # GGUF general.architecture: llama | qwen2 | qwen3 | gemma3
    key_length: int | None = None         # H when it is not D // N (Qwen3, Gemma 3: attention.key_length)
    qkv_bias: bool = False                # Qwen2: Q, K and V projections add a bias
    qk_norm: bool = False                 # Qwen3, Gemma 3: RMSNorm over each head's H values of q and k, before RoPE
    post_norms: bool = False              # Gemma 3: a norm after attention and after the MLP, before each residual add
    activation: str = "silu"              # the gated MLP's gate: "silu" (SwiGLU) | "gelu_tanh" (GeGLU, Gemma)
    embed_scale: float = 1.0              # Gemma: embeddings are multiplied by sqrt(D) before the first layer
    tied_embeddings: bool = True          # the LM head is the embedding (else the file has its own output matrix)
    attn_scale: float | None = None       # scores are q.k * attn_scale (None: 1/sqrt(H))
    sliding_window: int = 0               # Gemma 3: a local layer sees only the last `sliding_window` keys (0: none)
    sliding_window_pattern: int = 0       # every n-th layer is global (attends to everything), the others local
    rope_theta_local: float | None = None  # the local layers' RoPE base (Gemma 3: 10,000 beside 1,000,000)

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not is_int(value):  # 64.0 would break reshapes later
                raise ValueError(f"config: {name} must be an integer, got {value!r}")
            if value <= 0:
                raise ValueError(f"config: {name} must be positive, got {value}")
        if not self.rope_theta > 0 or not self.norm_eps > 0:  # `not >` also rejects NaN
            raise ValueError(f"config: rope_theta and norm_eps must be positive, got {self.rope_theta}, {self.norm_eps}")
        if self.key_length is None and self.dim % self.n_heads:
            raise ValueError(f"config: dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"config: activation must be 'silu' or 'gelu_tanh', got {self.activation!r}")
        if self.sliding_window < 0 or self.sliding_window_pattern < 0:
            raise ValueError(f"config: sliding_window and sliding_window_pattern must be >= 0, got "
                             f"{self.sliding_window}, {self.sliding_window_pattern}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"config: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"config: RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:   # H
        return self.key_length if self.key_length is not None else self.dim // self.n_heads

    def layer_window(self, layer: int) -> int | None:
        """How many of the latest keys layer `layer` attends to: None for a global layer (all of them).

        Gemma 3's pattern: with sliding_window_pattern 6, layers 5, 11, 17, ... are global, the rest local.
        """
        if not self.sliding_window:
            return None
        if self.sliding_window_pattern and (layer + 1) % self.sliding_window_pattern == 0:
            return None
        return self.sliding_window

    def layer_rope_theta(self, layer: int) -> float:
        """The RoPE base of layer `layer`: local layers may use their own (Gemma 3)."""
        if self.rope_theta_local is not None and self.layer_window(layer) is not None:
            return self.rope_theta_local
        return self.rope_theta

    def block_switches(self) -> list[str]:
        """The switches of this block that LLaMA's does not have ([] for LLaMA's): the fused LLaMA kernels
        (kernels/forward.py) run none of them, so a model with any runs kernels/block_forward.py (backend.py)."""
        return [what for what, needed in (
            ("Q/K/V biases", self.qkv_bias), ("Q/K norms", self.qk_norm),
            ("norms after attention and MLP", self.post_norms),
            (f"the {self.activation} MLP", self.activation != "silu"), ("a scaled embedding", self.embed_scale != 1.0),
            ("sliding windows", self.sliding_window > 0), ("a per-layer RoPE base", self.rope_theta_local is not None))
            if needed]

    @property
    def group_size(self) -> int:  # g: query heads that share one K/V head
        return self.n_heads // self.n_kv_heads

    # --- the Hugging Face config.json vocabulary -------------------------------------------------
    def to_hf_dict(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_seq_len,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps,
            "hidden_act": "silu",
            "tie_word_embeddings": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        eos = d.get("eos_token_id", 2)
        return cls(
            dim=d["hidden_size"],
            n_layers=d["num_hidden_layers"],
            n_heads=d["num_attention_heads"],
            n_kv_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            max_seq_len=d.get("max_position_embeddings", 8192),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            bos_token_id=d.get("bos_token_id", 1),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        )

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}: run `make weights` first")
        try:
            d = json.loads(path.read_text())
            if not isinstance(d, dict):
                raise TypeError(f"a JSON object is needed, got a JSON {type(d).__name__}")
            return cls.from_hf_dict(d)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path} is not a valid LLaMA config.json ({e}); delete it and run `make weights`") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")

    def __repr__(self) -> str:  # one line a learner can read
        d = asdict(self)
        return "ModelConfig(" + ", ".join(f"{k}={v}" for k, v in d.items()) + f", head_dim={self.head_dim})"
