"""Back-of-the-envelope formulas: predict a number before measuring it.

Started in lesson 3 with the KV cache and attention (functions of a ModelConfig, shapes in the legend of
config.py); lesson 6 adds the speculative-decoding expectations; lesson 9 the calculator for inference at scale
(ModelShape, Chip, step time, batch bounds, tensor-parallel traffic), with the chips' datasheet figures and this
machine's measured ones; lesson 11 the bytes of a matrix in a block format. Every function counts exactly what it says, so tests check it against hand-computed values.
FLOPs count a multiply-add as 2.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from .config import ModelConfig, check_positive_int
from .measure import time_repeated

# Published shapes of well-known models, for comparison with SmolLM2 (only the fields the formulas use matter).
LLAMA2_7B = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, intermediate_size=11008,
                        vocab_size=32000, max_seq_len=4096)                     # MHA
LLAMA2_13B = ModelConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, intermediate_size=13824,
                         vocab_size=32000, max_seq_len=4096)                    # MHA
LLAMA2_70B = ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, intermediate_size=28672,
                         vocab_size=32000, max_seq_len=4096)                    # GQA, g = 8
MISTRAL_7B = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                         vocab_size=32000, max_seq_len=32768)                   # GQA, g = 4


def with_kv_heads(config: ModelConfig, n_kv_heads: int) -> ModelConfig:
    """The same model with K key/value heads: K = N is MHA, K = 1 is MQA, anything between is GQA."""
    return replace(config, n_kv_heads=n_kv_heads)


def kv_bytes_per_token(config: ModelConfig, bytes_per_value: int = 4) -> int:
    """Bytes of KV cache one token occupies: 2 (K and V) * L * K * H * bytes per value."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * bytes_per_value


def kv_cache_bytes(config: ModelConfig, n_tokens: int, n_seqs: int = 1, bytes_per_value: int = 4) -> int:
    """Bytes of KV cache for n_seqs sequences of n_tokens tokens each."""
    return n_seqs * n_tokens * kv_bytes_per_token(config, bytes_per_value)


def attention_decode_flops(config: ModelConfig, context: int) -> int:
    """FLOPs of attention in one decode step (one new token over `context` cached positions), all layers.

    Per layer and query head: q.k over S keys (2*S*H) and the weighted sum of S values (2*S*H). The softmax
    (a few FLOPs per score) and the Q/K/V/O projections (counted with the weights) are left out.
    """
    return 4 * config.n_layers * config.n_heads * config.head_dim * context


def attention_decode_bytes(config: ModelConfig, context: int, bytes_per_value: int = 4,
                           repeat_kv: bool = False) -> int:
    """Bytes attention moves in one decode step: every cached K and V value is read once.

    With repeat_kv (lesson 2's np.repeat), each layer also writes the g-times repeated K and V ([S, N, H] each)
    and reads them back for the matmuls: 2 * (2 * S * N * H) values more per layer. Queries and outputs (N*H
    values) and scores (N*S) are ignored: about g / (2*H) of the cache traffic (2 % for SmolLM2).
    """
    read_cache = 2 * config.n_layers * context * config.n_kv_heads * config.head_dim
    repeated = 2 * 2 * config.n_layers * context * config.n_heads * config.head_dim if repeat_kv else 0
    return (read_cache + repeated) * bytes_per_value


def attention_arithmetic_intensity(config: ModelConfig, bytes_per_value: int = 2) -> float:
    """FLOPs per byte of decode attention (grouped, no repeat): 4*N*H*S / (2*K*H*S*b) = 2*g / b.

    Independent of the context length. With a 16-bit cache (b = 2) it is exactly g, the query heads per K/V head:
    each K/V value fetched from memory serves g query heads. MHA (g = 1) sits deep in the memory-bound region.
    """
    return attention_decode_flops(config, 1) / attention_decode_bytes(config, 1, bytes_per_value)


# --- speculative decoding (lesson 6; lesson 9's calculator reuses these) -------------------------------------------

def speculative_tokens_per_step(acceptance: float, k: int) -> float:
    """Expected tokens one verify step yields with k drafted tokens, each accepted with probability `acceptance`.

    Token i (1-based) of the draft survives only if all i before it did: P = a^i. The step always yields one token
    from the target (the correction, or the bonus when all k agree), so E = 1 + a + a^2 + ... + a^k
    = (1 - a^(k+1)) / (1 - a), which is k + 1 at a = 1 and 1 at a = 0.
    """
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be a probability in [0, 1], got {acceptance!r}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k (tokens drafted per step) must be an integer >= 0, got {k!r}")
    if acceptance == 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def speculative_best_k(acceptance: float, draft_cost: float, verify_cost: float, k_max: int = 16) -> int:
    """The draft length k in 0..k_max with the most expected tokens per unit of time.

    One step costs k * draft_cost + verify_cost (the target scores k + 1 rows in one forward, which at small batch
    costs about as much as one decode: the weights are read once) and yields speculative_tokens_per_step(a, k).
    k = 0 is plain decoding. Costs in any one unit (seconds, or relative to a decode step).
    """
    if draft_cost < 0 or verify_cost <= 0:
        raise ValueError(f"need draft_cost >= 0 and verify_cost > 0, got {draft_cost!r}, {verify_cost!r}")
    rate = [speculative_tokens_per_step(acceptance, k) / (k * draft_cost + verify_cost) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=rate.__getitem__)


# --- weight formats (lesson 11): the bytes of a matrix stored in blocks -------------------------------------------
# A decode step at batch 1 reads every weight once, so its floor is the weights' bytes, and those depend on the
# format: each run of `block` weights along a row is `bits`-bit integers plus, once per block, a float16 scale and,
# in the formats whose integers are unsigned, a float16 minimum. A scale per block is what lets a few bits follow
# the weights' range along the row; it is also why a "4-bit" format costs 4.5 to 5 bits a weight.

class BlockFormat(NamedTuple):
    """How a matrix is stored: per run of `block` weights along a row, `block` integers of `bits` bits, a scale of
    `scale_bytes` and a minimum of `min_bytes` (0: none, the integers are signed around zero)."""
    name: str
    block: int
    bits: int
    scale_bytes: int
    min_bytes: int = 0


Q8_0 = BlockFormat("Q8_0", 32, 8, 2)                   # GGUF: 32 signed bytes and a float16 scale
Q5_0 = BlockFormat("Q5_0", 32, 5, 2)
Q4_0 = BlockFormat("Q4_0", 32, 4, 2)
Q4_1 = BlockFormat("Q4_1", 32, 4, 2, 2)                # unsigned nibbles: a float16 minimum too
BYTE_TILE = BlockFormat("byte tile", 32, 8, 2, 2)       # the fast path's bytes 0..255 (quant.B8Linear): scale and minimum
# the byte tile without a minimum (quant.S8Linear): where m = -128 d throughout (Q8_0), the tile forms m from d
BYTE_TILE_NO_MIN = BlockFormat("byte tile without a minimum", 32, 8, 2)
NIBBLE_TILE = BlockFormat("nibble tile", 32, 4, 2, 2)   # the fast path's nibbles 0..15 (quant.Q4Linear)


def matrix_bytes(rows: int, cols: int, fmt: BlockFormat) -> int:
    """Bytes of a [rows, cols] matrix stored as `fmt`, its blocks running along each row of `cols` weights (an
    embedding: rows = V tokens, cols = D; a layer's weight: one row per output, its inputs along it)."""
    check_positive_int("rows", rows, "matrix_bytes")
    check_positive_int("cols", cols, "matrix_bytes")
    if cols % fmt.block:
        raise ValueError(f"matrix_bytes: a row of {cols} weights is not whole blocks of {fmt.block} ({fmt.name})")
    return rows * (cols // fmt.block) * (fmt.block * fmt.bits // 8 + fmt.scale_bytes + fmt.min_bytes)


# --- lesson 9: the calculator for inference at scale -----------------------------------------------------------------
#
# Decode reads every weight once per step whatever the batch (B rows share one read), does 2 FLOPs per weight per
# row, and reads every sequence's KV cache. A step therefore costs max(weight read, matmul FLOPs) + KV read: below
# the critical batch the weights' bytes dominate (memory-bound, step time flat in B), above it the FLOPs do
# (compute-bound, step time grows with B). The KV read is never shared between sequences, so it adds on top.
# Units: bytes, seconds, FLOP/s. GB here means 1e9 bytes, as chip datasheets use it.

@dataclass(frozen=True, slots=True)
class ModelShape:
    """The shapes that set a transformer's size, written out so any published model can be entered as given.

    head_dim is its own field: it need not be d_model // n_heads (the LLaMA-2-13B-like problem has 32 x 256).
    MoE: each layer has n_experts MLPs of d_ff each and a token uses experts_per_token of them.
    """
    n_layers: int             # L
    d_model: int              # D
    d_ff: int                 # F (per expert)
    n_heads: int              # N
    n_kv_heads: int           # K
    head_dim: int             # H
    vocab: int                # V
    tied_embeddings: bool = True
    n_experts: int = 1
    experts_per_token: int = 1

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "d_ff", "n_heads", "n_kv_heads", "head_dim", "vocab", "n_experts",
                     "experts_per_token"):
            check_positive_int(name, getattr(self, name), "ModelShape")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelShape: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.experts_per_token > self.n_experts:
            raise ValueError(f"ModelShape: experts_per_token {self.experts_per_token} > n_experts {self.n_experts}")

    @classmethod
    def from_config(cls, config: ModelConfig) -> "ModelShape":
        """The shape of a tinyserve model (SmolLM2: tied embeddings, dense)."""
        return cls(config.n_layers, config.dim, config.intermediate_size, config.n_heads, config.n_kv_heads,
                   config.head_dim, config.vocab_size)

    def attention_params(self) -> int:
        """Per layer: W_q [D, N*H] and W_o [N*H, D], W_k and W_v [D, K*H] each."""
        return 2 * self.d_model * self.head_dim * (self.n_heads + self.n_kv_heads)

    def mlp_params(self) -> int:
        """Per layer and expert: gate and up [D, F], down [F, D] (SwiGLU has three matrices, not two)."""
        return 3 * self.d_model * self.d_ff

    def embedding_params(self) -> int:
        """The token embedding [V, D], plus a separate LM head [D, V] unless it is tied to the embedding."""
        return self.vocab * self.d_model * (1 if self.tied_embeddings else 2)

    def params(self) -> int:
        """All weights: attention + every expert's MLP + embedding(s). Norms (2*L*D + D, < 0.1 %) are left out,
        and so is an MoE router (D * n_experts per layer)."""
        return self.n_layers * (self.attention_params() + self.n_experts * self.mlp_params()) + self.embedding_params()

    def active_params(self) -> int:
        """Weights one token multiplies with: its experts_per_token experts' MLPs, not all n_experts."""
        return (self.n_layers * (self.attention_params() + self.experts_per_token * self.mlp_params())
                + self.embedding_params())

    def kv_bytes_per_token(self, bytes_per_value: float = 2) -> float:
        """2 (K and V) * L * K * H * bytes per value (int8: 1, bf16: 2, fp32: 4)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_value


@dataclass(frozen=True, slots=True)
class Chip:
    """One accelerator (or this CPU): memory size and bandwidth, and peak matmul FLOP/s.

    link_bandwidth: bytes/s one chip sends to its neighbour, one way (ICI, NVLink, ...), for collectives;
    0 means no such link.
    """
    name: str
    hbm_bytes: float          # B
    hbm_bandwidth: float      # B/s
    flops: float              # FLOP/s (bf16 on accelerators, fp32 on this CPU)
    link_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        if not (self.hbm_bytes > 0 and self.hbm_bandwidth > 0 and self.flops > 0 and self.link_bandwidth >= 0):
            raise ValueError(f"Chip {self.name!r}: memory, bandwidth and FLOP/s must be positive, got {self!r}")


# Public datasheet figures (bf16 dense). TPU v5e: ICI 4.5e10 B/s one way per link. H100 SXM: NVLink 4 is 9e11 B/s
# both ways together, 4.5e11 one way.
TPU_V5E = Chip("TPU v5e", 16e9, 8.1e11, 1.97e14, link_bandwidth=4.5e10)
H100 = Chip("H100 SXM", 80e9, 3.35e12, 9.89e14, link_bandwidth=4.5e11)


BANDWIDTH_BYTES = 256 * 2**20     # measure_bandwidth's buffer: well above the last-level cache of most machines


def measure_bandwidth(nbytes: int = BANDWIDTH_BYTES, repeat: int = 7, kind: str = "read") -> float:
    """Memory bandwidth of this machine in bytes/s, measured now: the median of `repeat` timed passes.

    kind="read" (the default, what decode needs): a float32 matrix-vector product over an `nbytes` matrix, the
    very access pattern of streaming weights; it runs on BLAS's threads (all cores: 2 here), and counts the
    matrix's bytes only. kind="copy": np.copyto between two `nbytes` buffers, one thread, counting read + write
    (2 * nbytes); usually above one core's read figure, below the all-core read figure.
    Choose nbytes well above the last-level cache (`lscpu` says how large) or you measure the cache. Shared machines are
    noisy: the median of a few repeats (measure.time_repeated), and only ratios measured in one run are worth
    comparing.
    """
    import numpy as np

    nbytes = check_positive_int("nbytes", nbytes, "measure_bandwidth")
    repeat = check_positive_int("repeat", repeat, "measure_bandwidth")
    cols = 4096
    rows = max(1, nbytes // (4 * cols))
    a = np.ones((rows, cols), np.float32)                     # [rows, cols]: every page touched, so really mapped
    if kind == "read":
        x = np.ones(cols, np.float32)
        run, moved = (lambda: a @ x), a.nbytes
    elif kind == "copy":
        b = np.empty_like(a)
        run, moved = (lambda: np.copyto(b, a)), 2 * a.nbytes
    else:
        raise ValueError(f"measure_bandwidth: kind must be 'read' or 'copy', got {kind!r}")
    # one warm-up call: page faults, BLAS threads waking up
    return moved / time_repeated(run, repeat, warmup=1).median


def measure_flops(n: int = 1024, repeat: int = 5) -> float:
    """float32 matmul FLOP/s of this machine (BLAS, all its threads): median of `repeat` [n, n] @ [n, n] products,
    after one untimed."""
    import numpy as np

    n = check_positive_int("n", n, "measure_flops")
    repeat = check_positive_int("repeat", repeat, "measure_flops")
    a = np.ones((n, n), np.float32)
    return 2 * n**3 / time_repeated(lambda: a @ a, repeat, warmup=1).median


def this_cpu(bandwidth: float | None = None, flops: float | None = None) -> Chip:
    """This machine as a Chip: its RAM, its read bandwidth and fp32 matmul FLOP/s measured on the spot
    unless given. The bandwidth is measure_bandwidth(kind="read"): what streaming the weights can reach."""
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Chip(f"this CPU ({os.cpu_count()} cores)", float(ram),
                measure_bandwidth() if bandwidth is None else bandwidth,
                measure_flops() if flops is None else flops)


def _check_chips(n_chips, kv_shards) -> int:
    check_positive_int("n_chips", n_chips)
    kv_shards = n_chips if kv_shards is None else check_positive_int("kv_shards", kv_shards)
    if kv_shards > n_chips:
        raise ValueError(f"kv_shards ({kv_shards}) cannot exceed n_chips ({n_chips}): the KV cache is spread over "
                         "at most all the chips")
    return kv_shards


def critical_batch(chip: Chip, bytes_per_param: float, n_experts: int = 1, experts_per_token: int = 1) -> float:
    """The decode batch at which the weight matmuls turn from memory-bound to compute-bound.

    A step reads P * bytes_per_param bytes of weights (time P*b / W) and does 2*P*B FLOPs (time 2*P*B / F): equal
    at B = F * b / (2 * W), whatever the model's size. bf16 weights on a TPU v5e: ~243; int8 weights: half that
    (fewer bytes per weight, the same FLOPs). MoE: each expert sees only B * experts_per_token / n_experts of the
    batch's tokens, so the batch must be n_experts / experts_per_token times larger before every expert's matmul
    is compute-bound.
    """
    check_positive_int("n_experts", n_experts)
    check_positive_int("experts_per_token", experts_per_token)
    if not bytes_per_param > 0:
        raise ValueError(f"bytes_per_param must be positive, got {bytes_per_param!r}")
    return chip.flops * bytes_per_param / (2 * chip.hbm_bandwidth) * n_experts / experts_per_token


def decode_step_time(chip: Chip, n_chips: int, batch: int, params: float, kv_bytes_per_sequence: float,
                     bytes_per_param: float, kv_shards: int | None = None) -> float:
    """Lower bound on one decode step, seconds: max(weight read, matmul FLOPs) + the KV read, per chip.

    The weights are split over n_chips (each reads its 1/n_chips share), so are the FLOPs; the KV cache of the
    batch is split over kv_shards chips (default: all; sharding by KV head gives at most n_kv_heads, the other
    chips hold replicas, so each reads 1/kv_shards of it). Attention FLOPs and communication are left out.
    """
    kv_shards = _check_chips(n_chips, kv_shards)
    check_positive_int("batch", batch, "decode_step_time")
    weights = params * bytes_per_param / (n_chips * chip.hbm_bandwidth)
    flops = 2 * params * batch / (n_chips * chip.flops)
    kv = batch * kv_bytes_per_sequence / (kv_shards * chip.hbm_bandwidth)
    return max(weights, flops) + kv


def max_batch(chip: Chip, n_chips: int, context: int, params: float, kv_bytes_per_token: float,
              bytes_per_param: float, reserved_bytes: float = 0, kv_shards: int | None = None) -> int:
    """How many sequences of `context` tokens fit beside the weights: the capacity bound on the batch.

    Per chip: hbm_bytes - reserved_bytes (activations, runtime) - its 1/n_chips of the weights is left for KV;
    each sequence puts context * kv_bytes_per_token / kv_shards bytes on every chip. 0 if the weights alone
    do not fit.
    """
    kv_shards = _check_chips(n_chips, kv_shards)
    check_positive_int("context", context)
    free = chip.hbm_bytes - reserved_bytes - params * bytes_per_param / n_chips
    if free <= 0:
        return 0
    return int(free // (context * kv_bytes_per_token / kv_shards))


def largest_batch_within(chip: Chip, n_chips: int, step_time: float, params: float, kv_bytes_per_sequence: float,
                         bytes_per_param: float, kv_shards: int | None = None) -> int:
    """The largest batch whose decode_step_time stays within `step_time` (an inter-token latency target).

    max(w, c*B) + k*B <= T holds iff both w + k*B <= T (memory-bound branch) and (c + k)*B <= T (compute-bound
    branch), so B = floor(min((T - w) / k, T / (c + k))). 0 if even reading the weights takes longer than T.
    """
    kv_shards = _check_chips(n_chips, kv_shards)
    w = params * bytes_per_param / (n_chips * chip.hbm_bandwidth)
    c = 2 * params / (n_chips * chip.flops)
    k = kv_bytes_per_sequence / (kv_shards * chip.hbm_bandwidth)
    if step_time < w:
        return 0
    return int(min((step_time - w) / k if k else float("inf"), step_time / (c + k)))


def prefill_time(chip: Chip, n_chips: int, tokens: int, params: float, bytes_per_param: float) -> float:
    """Lower bound on prefilling `tokens` prompt tokens, seconds: max(2 * P * T FLOPs, one weight read) per chip.

    A long prompt is a batch of `tokens` rows for the matmuls: far above the critical batch, so compute-bound.
    Attention's own FLOPs (4 * L * N * H * T^2 / 2 with the causal mask) are left out: small below ~10k tokens.
    """
    check_positive_int("n_chips", n_chips)
    check_positive_int("tokens", tokens)
    return max(2 * params * tokens / (n_chips * chip.flops), params * bytes_per_param / (n_chips * chip.hbm_bandwidth))


@dataclass(frozen=True, slots=True)
class DisaggregatedRates:
    prefill: float       # requests/s the prefill group can start
    decode: float        # requests/s the decode group can finish
    handover: float      # requests/s whose KV cache the link between the groups can carry


def disaggregated_rates(chip: Chip, prefill_chips: int, decode_chips: int, prompt_len: int, output_len: int,
                        decode_batch: int, params: float, kv_bytes_per_token: float, bytes_per_param: float,
                        link_bandwidth: float) -> DisaggregatedRates:
    """Request rates of a disaggregated deployment: a prefill group, a decode group and the link between them.

    The prefill group runs one prompt at a time (compute-bound, so batching prompts would not help): 1 / prefill
    time. The decode group keeps decode_batch sequences of prompt + output/2 tokens on average (the context grows
    during decode) and finishes decode_batch requests every output_len steps. Every request's KV cache
    (prompt_len * kv_bytes_per_token) must cross the link once. The slowest of the three is the system's rate.
    """
    check_positive_int("output_len", output_len)
    check_positive_int("decode_batch", decode_batch)
    if not link_bandwidth > 0:
        raise ValueError(f"link_bandwidth must be positive, got {link_bandwidth!r}")
    prefill = 1.0 / prefill_time(chip, prefill_chips, prompt_len, params, bytes_per_param)
    mean_context = prompt_len + output_len / 2
    step = decode_step_time(chip, decode_chips, decode_batch, params, mean_context * kv_bytes_per_token,
                            bytes_per_param)
    decode = decode_batch / (step * output_len)
    handover = link_bandwidth / (prompt_len * kv_bytes_per_token)
    return DisaggregatedRates(prefill, decode, handover)


def tensor_parallel_bytes_per_token(shape: ModelShape, n_devices: int, bytes_per_value: float = 4,
                                    logits: bool = True) -> float:
    """Bytes all devices together send per token in Megatron-style tensor parallelism with ring collectives.

    Each layer ends its attention (row-parallel W_o) and its MLP (row-parallel W_down) with partial sums of the
    [D] residual update: two all-reduces of D values. A ring all-reduce of n bytes over P devices sends
    2 * (P - 1) / P * n per device (reduce-scatter, then all-gather), 2 * (P - 1) * n in all. The vocab-parallel
    LM head then all-gathers the [V] logits: (P - 1) / P * V values per device, (P - 1) * V in all.
    """
    P = check_positive_int("n_devices", n_devices)
    per_layer = 2 * 2 * (P - 1) * shape.d_model * bytes_per_value
    return shape.n_layers * per_layer + ((P - 1) * shape.vocab * bytes_per_value if logits else 0)


def tensor_parallel_comm_time(chip: Chip, shape: ModelShape, n_devices: int, batch: int,
                              bytes_per_value: float = 2, hop_latency: float = 0.0) -> float:
    """Seconds per decode step each device spends in tensor-parallel collectives over chip.link_bandwidth.

    Its share (1/P) of tensor_parallel_bytes_per_token for `batch` tokens, sent one way round a ring, plus
    hop_latency for every ring step: 2 * (P - 1) per all-reduce, 2 * L all-reduces, and P - 1 for the logits.
    Bytes grow with the batch while a device's weight read does not: at large batch the link, not the memory,
    sets the step time — which is why tensor parallelism stays inside one fast-linked node (8 GPUs, a TPU slice).
    """
    P = check_positive_int("n_devices", n_devices)
    check_positive_int("batch", batch)
    if P == 1:
        return 0.0
    if not chip.link_bandwidth > 0:
        raise ValueError(f"{chip.name} has no link_bandwidth: give the Chip one to time collectives")
    per_device = batch * tensor_parallel_bytes_per_token(shape, P, bytes_per_value) / P
    hops = shape.n_layers * 2 * 2 * (P - 1) + (P - 1)
    return per_device / chip.link_bandwidth + hops * hop_latency
