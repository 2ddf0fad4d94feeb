"""Lesson 6: speculative decoding — draft k tokens cheaply, verify them all in one forward of the target.

A decode step at small batch is bound by reading the weights (lesson 2's roofline), not by arithmetic: the target
can score k + 1 rows for about the price of one. So a drafter (drafters.py) guesses k tokens, the target runs the
last sampled token plus the k guesses as one rectangular block over its KV cache (lesson 2's prefill path), and
row i of the result is the target's prediction after draft[:i]. Verification keeps the longest acceptable prefix
of the draft, then takes one token from the target (the correction at the first rejection, or a bonus token after
row k when all k were accepted): every step yields between 1 and k + 1 tokens, and the output is the target's.

    greedy      accept draft[i] iff it is the target's argmax at row i: token-identical to plain greedy decoding.
    stochastic  accept x = draft[i] with probability min(1, p(x) / q(x)), else draw from the normalised residual
                max(0, p - q): the output has exactly the target's distribution p, whatever the drafter's q
                (Leviathan et al. 2023; Chen et al. 2023).

The rejected draft tokens' K/V leave the cache (rewind: kv_cache.rewind for the contiguous cache, rewind_blocks
for a paged block table). The expected tokens per step, (1 - α^(k+1)) / (1 - α), and the best k are in roofline.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .config import check_positive_int, is_int
from .drafters import Draft, Drafter, NgramDrafter, draw
from .kv_cache import KVCache, forward_with_cache, prefill
from .kv_sizing import blocks_for, max_kv_positions
from .measure import time_repeated
from .model import Model
from .paged import BlockAllocator
from .roofline import speculative_best_k, speculative_tokens_per_step
from .sampling import SamplingParams, probabilities, sample
from .stopping import start_request

# One more row in the verify forward, relative to a whole decode step. At batch 1 the weights are read once for
# all rows, so each extra row costs its arithmetic (and attention) only: a few percent of a step
# (tools/bench_speculative.py measures it). The adaptive k charges it to every drafted token, next to the drafter's
# own cost.
VERIFY_ROW_COST = 0.05


def _seen(seen: Sequence[int], params: SamplingParams) -> list[int] | tuple:
    # only the repetition penalty looks at earlier tokens: skip copying the context when it is off
    return list(seen) if params.repetition_penalty != 1.0 else ()


def _check_rows(logits: np.ndarray, draft: Sequence[int]) -> None:
    if logits.ndim != 2 or logits.shape[0] != len(draft) + 1:
        raise ValueError(f"verification needs k + 1 = {len(draft) + 1} rows of target logits (one per draft "
                         f"token plus the bonus row), got shape {logits.shape}")


def verify_greedy(logits: np.ndarray, draft: Sequence[int], params: SamplingParams,
                  seen: Sequence[int] = ()) -> list[int]:
    """Greedy verification: the accepted prefix of `draft` plus one token of the target's.

    logits: [k + 1, V], row i = the target's logits after the context (`seen`) + draft[:i]; draft: [k] token ids.
    Accept draft[i] while it equals the target's greedy choice at row i; the first disagreement is replaced by the
    target's token and ends the step; if all k agree, row k gives a bonus token. Returns 1 .. k + 1 tokens.
    """
    _check_rows(logits, draft)
    if not params.greedy:
        raise ValueError("verify_greedy needs greedy params (temperature 0 or top_k 1); use verify_stochastic")
    ctx = _seen(seen, params)
    out: list[int] = []
    for i in range(len(draft) + 1):
        tok = sample(logits[i], params, None, seen=ctx)   # greedy: argmax after the repetition penalty, no rng
        out.append(tok)
        if i == len(draft) or tok != draft[i]:
            return out
        if ctx != ():
            ctx.append(tok)
    raise AssertionError("unreachable: the loop returns at row k at the latest")


def verify_stochastic(logits: np.ndarray, draft: Sequence[int], draft_probs: np.ndarray | None,
                      params: SamplingParams, rng: np.random.Generator, seen: Sequence[int] = ()) -> list[int]:
    """Stochastic verification (speculative sampling): the output is distributed exactly as the target's.

    logits: [k + 1, V] target logits (row i after seen + draft[:i]); draft: [k]; draft_probs: [k, V] the q each
    draft token was drawn from, or None for a deterministic drafter (q one-hot on its token). p_i is the very
    distribution sampling.sample would draw from (temperature, top-k/p, min-p, repetition penalty).
    Accept draft[i] = x with probability min(1, p_i(x) / q_i(x)); on the first rejection draw from the residual
    max(0, p_i - q_i), normalised, and stop; if all k are accepted, draw a bonus token from p_k.
    """
    _check_rows(logits, draft)
    k, V = len(draft), logits.shape[1]
    if draft_probs is not None and draft_probs.shape != (k, V):
        raise ValueError(f"draft_probs must be [k, V] = [{k}, {V}] (one q per draft token), got {draft_probs.shape}")
    ctx = _seen(seen, params)
    out: list[int] = []
    for i, x in enumerate(draft):
        p = probabilities(logits[i], params, ctx)                                  # [V]
        if draft_probs is None:
            q = np.zeros(V)
            q[x] = 1.0                                                             # [V] one-hot
        else:
            q = draft_probs[i]                                                     # [V]
        # u < p/q without dividing (q(x) > 0: the drafter drew x from q)
        if rng.random() * q[x] < p[x]:
            out.append(int(x))
            if ctx != ():
                ctx.append(int(x))
            continue
        # Rejected. Where q over-proposes (q > p) acceptance already gave those tokens exactly p; the mass still
        # missing is max(0, p - q), so the replacement must come from there (drawing from p would count them twice)
        residual = np.maximum(p - q, 0.0)                                          # [V]
        out.append(draw(residual, rng) if residual.sum() > 0 else draw(p, rng))   # (p == q: float round-off only)
        return out
    out.append(draw(probabilities(logits[k], params, ctx), rng))                  # all k accepted: the bonus
    return out


def verify(logits: np.ndarray, draft: Draft, params: SamplingParams, rng: np.random.Generator,
           seen: Sequence[int] = ()) -> list[int]:
    """Greedy verification for greedy params (token-identical to plain decoding), stochastic otherwise."""
    if params.greedy:
        return verify_greedy(logits, draft.tokens, params, seen)
    return verify_stochastic(logits, draft.tokens, draft.probs, params, rng, seen)


def rewind_blocks(block_table: list[int], num_tokens: int, n: int, block_size: int,
                  allocator: BlockAllocator) -> list[int]:
    """Drop the last n of a paged sequence's num_tokens positions; returns the blocks it let go of.

    The table keeps the blocks_for(num_tokens - n) blocks that still hold a kept position (a partly kept block
    stays: its stale tail is overwritten by the next append, and attention never reads past the context length);
    every later block is removed from the table and decref'd (freed, unless another owner still holds it).
    Edits `block_table` in place. n = 0 is a no-op; n = num_tokens empties the table.
    """
    if not is_int(num_tokens) or not 0 <= num_tokens <= len(block_table) * block_size:
        raise ValueError(f"rewind_blocks: num_tokens must be in [0, {len(block_table) * block_size}] "
                         f"(what {len(block_table)} blocks of {block_size} hold), got {num_tokens!r}")
    if not is_int(n) or not 0 <= n <= num_tokens:
        raise ValueError(f"rewind_blocks: n must be an integer in [0, {num_tokens}], got {n!r}")
    keep = blocks_for(num_tokens - n, block_size)
    dropped = block_table[keep:]
    del block_table[keep:]
    for block in reversed(dropped):
        allocator.decref(block)
    return dropped


# --- how long a draft? ------------------------------------------------------------------------------------------

@dataclass(slots=True)
class SpecStats:
    """What verification did for one request (or a whole run: stats add up)."""
    steps: int = 0          # verify forwards
    drafted: int = 0        # draft tokens proposed
    accepted: int = 0       # of those, accepted
    rejected: int = 0       # steps that ended on a rejected draft token (the others accepted all they drafted)
    emitted: int = 0        # tokens the steps yielded (accepted + corrections + bonuses; cut short by stopping): all
                            # but the first new token, which the prompt's prefill yields
    ks: list[int] = field(default_factory=list)        # [steps] tokens drafted at each step
    accepts: list[int] = field(default_factory=list)   # [steps] of those, accepted

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejected += accepted < drafted
        self.ks.append(drafted)
        self.accepts.append(accepted)

    @property
    def alpha(self) -> float:
        """α of roofline.speculative_tokens_per_step: the chance that a draft token the target looks at is
        accepted. Each examined token is a coin flip; a step examines its accepted tokens and, if it stopped
        early, the one it rejected: α = accepted / (accepted + rejected), the maximum-likelihood estimate."""
        n = self.accepted + self.rejected
        return self.accepted / n if n else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted: lower than α when long drafts are cut at their first rejection."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else float("nan")

    def __add__(self, other: "SpecStats") -> "SpecStats":
        return SpecStats(self.steps + other.steps, self.drafted + other.drafted, self.accepted + other.accepted,
                         self.rejected + other.rejected, self.emitted + other.emitted, self.ks + other.ks,
                         self.accepts + other.accepts)


@dataclass(slots=True)
class AdaptiveK:
    """Pick each step's k from the acceptance measured so far, with roofline's expected-tokens formula.

    Costs are relative to one plain decode step (= 1): a drafted token costs the drafter's `draft_cost`, and
    verifying k drafts costs `verify_costs[k]` (k + 1 rows in one forward; measure_verify_costs measures it on this
    machine) or, when not given, roofline's model 1 + VERIFY_ROW_COST * k, which speculative_best_k solves.
    α is estimated from decayed counts (recent steps weigh more: a request moves between quoting and free text),
    starting from a prior of one acceptance and one rejection (α = 0.5). When the formula says drafting loses
    (best k = 0) the request decodes plainly, but every `probe_every`-th step still drafts (the best k >= 1):
    a request that stopped drafting would never measure α again.
    """
    k_max: int = 8
    draft_cost: float = 0.0
    verify_costs: tuple[float, ...] | None = None   # [k_max + 1] cost of a verify step with k drafts
    decay: float = 0.9
    accepted: float = 1.0
    rejected: float = 1.0
    probe_every: int = 8
    idle: int = 0                # steps in a row without a draft

    def __post_init__(self) -> None:
        check_positive_int("k_max", self.k_max, "AdaptiveK")
        if self.verify_costs is not None and len(self.verify_costs) < self.k_max + 1:
            raise ValueError(f"AdaptiveK: verify_costs needs k_max + 1 = {self.k_max + 1} entries (k = 0 .. k_max), "
                             f"got {len(self.verify_costs)}")

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:   # a step without a draft says nothing about α
            self.accepted = self.decay * self.accepted + accepted
            self.rejected = self.decay * self.rejected + (accepted < drafted)

    def next_k(self) -> int:
        if self.verify_costs is None:
            best = speculative_best_k(self.alpha, self.draft_cost + VERIFY_ROW_COST, 1.0, self.k_max)
            rate = None
        else:
            rate = [speculative_tokens_per_step(self.alpha, k) / (k * self.draft_cost + self.verify_costs[k])
                    for k in range(self.k_max + 1)]
            best = max(range(self.k_max + 1), key=rate.__getitem__)
        if best > 0:
            self.idle = 0
            return best
        self.idle += 1
        if self.idle < self.probe_every:
            return 0
        self.idle = 0                    # probe: the best k that drafts at all
        if rate is None:
            return max(1, speculative_best_k(self.alpha, 0.0, 1.0 + self.draft_cost + VERIFY_ROW_COST, 1))
        return max(range(1, self.k_max + 1), key=rate.__getitem__)


def measure_verify_costs(model: Model, k_max: int, history: int = 64, repeat: int = 3,
                         grid: Sequence[int] = (0, 1, 2, 4, 8, 16)) -> tuple[float, ...]:
    """The time of one forward of k + 1 rows over `history` cached positions, relative to one row (a plain decode
    step), for k = 0 .. k_max: medians of `repeat` runs at the k of `grid`, linear in between.

    The roofline says the k + 1 rows cost about one row (the weights are read once). Whether the matmul library
    agrees is a property of this machine: NumPy's BLAS switches from a matrix-vector to a matrix-matrix kernel at
    two rows, which on some CPUs costs several decode steps by itself.
    """
    k_max = check_positive_int("k_max", k_max, "measure_verify_costs")
    ks = sorted({min(k, k_max) for k in grid} | {0, k_max})
    cache = KVCache.allocate(model.config, min(model.config.max_seq_len, history + k_max + 1))
    ids = (np.arange(history + k_max + 1) % (model.config.vocab_size - 3) + 3).tolist()
    forward_with_cache(model, cache, ids[:history])
    seconds = []
    for k in ks:                                     # every run sees the same `history`: its k + 1 rows rewound
        rows = ids[history:history + k + 1]
        seconds.append(time_repeated(lambda: forward_with_cache(model, cache, rows, all_logits=True), repeat,
                                     warmup=1, reset=lambda: cache.rewind(len(rows))).median)
    rel = np.interp(np.arange(k_max + 1), ks, np.asarray(seconds) / seconds[0])
    return tuple(float(c) for c in rel)


def draft_length(k: int, adaptive: AdaptiveK | None, num_out: int, max_new_tokens: int, room: int) -> int:
    """Tokens to draft this step: k (or the adaptive choice), but never more than the request can still emit
    (the step itself adds one) or than the KV cache / context window has room for."""
    want = adaptive.next_k() if adaptive is not None else k
    return max(0, min(want, max_new_tokens - num_out - 1, room))


# --- the generate loop on the contiguous KV cache ----------------------------------------------------------------

def generate_stream(model: Model, ids: Sequence[int], max_new_tokens: int | None = None,
                    params: SamplingParams | None = None, tokenizer=None, drafter: Drafter | None = None,
                    k: int = 4, adaptive: bool = False, stats: SpecStats | None = None,
                    prefill_chunk: int | None = None, attend=None,
                    verify_costs: Sequence[float] | None = None) -> Iterator[int]:
    """Yield new token ids like kv_cache.generate_stream, several per target forward when drafts are accepted.

    drafter: default NgramDrafter(). k: tokens drafted per step (k_max when adaptive; verify_costs, e.g. from
    measure_verify_costs, then replaces roofline's constant verify cost). stats: filled in as the request runs.
    attend: None (kv_cache's choice: the backend's attention, and on numba the fused step for verifies of up to 8
    rows, kernels/decode_step.MAX_ROWS) or an attention function. Stops exactly where plain decoding stops (EOS,
    stop string, max tokens, context window), even inside an accepted run: the stopping rule sees every token one by
    one.
    """
    params = params or SamplingParams()
    drafter = drafter if drafter is not None else NgramDrafter()
    k = check_positive_int("k", k, "speculative decoding")
    stats = stats if stats is not None else SpecStats()
    tokens, stopper, rng = start_request(model.config, ids, max_new_tokens, params, tokenizer)  # prompt: [T]
    cfg = model.config
    # plain decoding's positions plus room for one step's draft (its rejected part is rewound right after)
    cache = KVCache.allocate(cfg, min(cfg.max_seq_len,
                                      max_kv_positions(len(tokens), stopper.max_new_tokens, cfg.max_seq_len) + k))
    # the whole prompt, as plain decoding prefills it: its last row's logits give the first new token. (Were the
    # last prompt token instead the first verify's first row, a quantised model would compute it in the fused step's
    # kernels where plain decoding uses the prefill's: their attention adds in another order, int8 activations can
    # round the ~1e-7 apart, and at a near tie greedy speculation then decodes other tokens than plain decoding.)
    logits = prefill(model, cache, tokens, prefill_chunk, attend)                   # [V]
    control = AdaptiveK(k, drafter.cost, tuple(verify_costs) if verify_costs is not None else None) \
        if adaptive else None
    seq = [int(t) for t in tokens]                     # prompt + output; seq[-1] is not in the cache yet
    out = [sample(logits, params, rng, seen=seq)]
    seq.append(out[0])
    yield out[0]
    if stopper.should_stop(out):
        return
    while True:
        n_draft = draft_length(k, control, len(out), stopper.max_new_tokens, cache.max_len - len(seq))
        draft = drafter.propose(seq, n_draft, params, rng) if n_draft else Draft([])
        assert len(draft) <= n_draft, f"{drafter.name} proposed {len(draft)} tokens, more than the {n_draft} asked"
        logits = forward_with_cache(model, cache, [seq[-1], *draft.tokens], attend, all_logits=True)  # [k+1, V]
        new = verify(logits, draft, params, rng, seq)
        accepted = len(new) - 1
        cache.rewind(len(draft) - accepted)             # the rejected draft tokens' K/V leave the cache
        stats.record(len(draft), accepted)
        if control is not None:
            control.update(len(draft), accepted)
        for tok in new:
            out.append(tok)
            seq.append(tok)
            stats.emitted += 1
            yield tok
            if stopper.should_stop(out):
                return
        assert cache.length == len(seq) - 1  # after verification the cache holds every token but the newest


def generate(model: Model, ids: Sequence[int], max_new_tokens: int | None = None,
             params: SamplingParams | None = None, tokenizer=None, drafter: Drafter | None = None,
             k: int = 4, adaptive: bool = False, stats: SpecStats | None = None,
             verify_costs: Sequence[float] | None = None) -> list[int]:
    """The new token ids only (prompt excluded); greedy params give exactly kv_cache.generate's tokens."""
    return list(generate_stream(model, ids, max_new_tokens, params, tokenizer, drafter, k, adaptive, stats,
                                verify_costs=verify_costs))
