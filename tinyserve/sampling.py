"""From logits to the next token: greedy, temperature, top-k, top-p, min-p, repetition penalty.

Every request carries its own `SamplingParams` and its own seeded `numpy.random.Generator`, so a request's
output does not depend on what else is in the batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .config import is_int


MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_LOGPROBS = 20                     # OpenAI's top_logprobs bound


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0          # 0 means greedy (argmax)
    top_k: int = 0                    # 0 means off; keep the k most likely tokens
    top_p: float = 1.0                # 1 means off; keep the smallest set whose probability reaches top_p
    min_p: float = 0.0                # 0 means off; drop tokens less likely than min_p * p(best token)
    repetition_penalty: float = 1.0   # 1 means off; > 1 discourages tokens already in prompt or output
    max_new_tokens: int = 64
    stop: tuple[str, ...] = field(default=())   # stop strings (checked on the decoded text)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None       # None means off; k >= 0: report each token's log-probability and the k best
    json_schema: dict | bool | None = None      # structured output: the text is JSON valid under this schema (a
                                                # subset: constrained/schema.py); {} or True: any JSON value

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"SamplingParams: {msg}")

        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        # Bounded so that dividing a logit by it cannot overflow (1e-39 turned every seen logit into inf): at 100
        # a seen token is already out of the running, beyond it only the risk of overflow grows.
        if not _is_number(self.repetition_penalty) or not math.isfinite(self.repetition_penalty) \
                or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad(f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] "
                f"(1 = off), got {self.repetition_penalty!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            bad(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not all(isinstance(s, str) and s for s in self.stop):
            bad(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            bad(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.json_schema is not None:
            from .constrained import compile_schema, schema_key
            schema_key(self.json_schema)
            compile_schema(self.json_schema)      # an unsupported schema is refused here, naming the keyword
        if self.logprobs is not None and self.json_schema is not None:
            bad("logprobs with json_schema: a grammar's forced tokens are emitted without a forward pass, so they "
                "have no log-probabilities")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def make_rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def apply_repetition_penalty(logits: np.ndarray, seen: Sequence[int], penalty: float) -> np.ndarray:  # [V] -> [V]
    # CTRL's rule (as in transformers): divide positive logits, multiply negative ones, so a seen token
    # always becomes less likely whatever its sign.
    if penalty == 1.0 or len(seen) == 0:
        return logits
    out = logits.astype(np.float64)   # float64: a float32 logit / 0.01 could overflow near float32's max
    idx = np.unique(np.asarray(seen))
    vals = out[idx]
    out[idx] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:  # [V] -> [V], -inf outside the k largest
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    # exactly k, even on ties: `logits >= kth value` would keep every token tied with the k-th one
    keep = np.argpartition(logits, -k)[-k:]
    out = np.full_like(logits, -np.inf)
    out[keep] = logits[keep]
    return out


def top_p_filter(probs: np.ndarray, p: float) -> np.ndarray:  # [V] probabilities -> [V], renormalised
    """Nucleus sampling: keep the most likely tokens until their mass reaches p, *including* the token that
    crosses the threshold (otherwise a single token with probability 0.95 and p=0.9 would keep nothing)."""
    if p >= 1.0:
        return probs
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    # mass of the tokens strictly before each one; a token is kept if that mass is still below p
    keep_sorted = (cum - probs[order]) < p
    out = np.zeros_like(probs)
    kept = order[keep_sorted]
    out[kept] = probs[kept]
    return out / out.sum()


def min_p_filter(probs: np.ndarray, min_p: float) -> np.ndarray:  # [V] -> [V], renormalised
    # Scale-aware truncation: when the model is sure (p_max high) few tokens survive, when unsure many do.
    if min_p <= 0.0:
        return probs
    out = np.where(probs >= min_p * probs.max(), probs, 0.0)
    return out / out.sum()


def probabilities(logits: np.ndarray, params: SamplingParams, seen: Sequence[int] = ()) -> np.ndarray:
    """The distribution a non-greedy sample is drawn from: [V] logits -> [V] float64 probabilities."""
    x = apply_repetition_penalty(logits.astype(np.float64), seen, params.repetition_penalty)  # [V]
    x = top_k_filter(x, params.top_k)                                                         # [V]
    best = _check_best(x.max())
    # Subtract the max *before* dividing by the temperature: the best token's exponent is exactly 0, so a tiny
    # temperature (1e-310) sends the others to exp(-inf) = 0 instead of turning everything into inf - inf = NaN.
    with np.errstate(over="ignore"):  # (x - best) / 1e-310 overflowing to -inf is exactly what we want
        probs = np.exp((x - best) / params.temperature)                                       # [V]
    probs /= probs.sum()
    probs = top_p_filter(probs, params.top_p)
    return min_p_filter(probs, params.min_p)


def _check_best(best: float) -> float:
    # NaN anywhere makes the max NaN; all -inf (everything filtered) or a +inf logit leaves no distribution.
    if not np.isfinite(best):
        raise ValueError(f"logits contain NaN or no finite maximum (max = {best}): cannot sample a token")
    return best


def sample_tokens(seq, logits: np.ndarray, seen: Sequence[int] = (), sampler=None) -> tuple[list[int], list | None]:
    """The Engine's sampling step for one request (a sequence.Sequence): ([one token], its logprobs if the request
    asks) from logits [V], or, with a json_schema, a token drawn from the logits masked by its grammar (disallowed
    tokens -inf, so the distribution is renormalised over the allowed ones) followed by the tokens the grammar then
    forces (jump-forward, constrained/), never more than max_new_tokens or the context window leave room for.
    `sampler`: `sample` unless given."""
    sampler = sampler or sample
    c = seq.constraint
    if c is None:
        return sample_step(logits, seq.params, seq.rng, seen, sampler)
    token = sampler(c.apply(logits), seq.params, seq.rng, seen=seen)
    stop = seq.stopper
    room = min(stop.max_new_tokens - len(seq.output_ids), stop.config.max_seq_len - seq.num_tokens - 1) - 1
    return c.accept(token, max_forced=room), None      # (SamplingParams refuses logprobs with a json_schema)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, seen: Sequence[int] = ()) -> int:
    """One token id from one row of logits [V]."""
    if params.greedy:
        x = apply_repetition_penalty(logits, seen, params.repetition_penalty)                 # [V]
        idx = int(np.argmax(x))   # the first NaN if there is one, so checking this one value is enough
        _check_best(x[idx])
        return idx
    probs = probabilities(logits, params, seen)                                               # [V]
    assert np.isfinite(probs).all() and probs.sum() > 0, "the sampling distribution must be finite and positive"
    # inverse-CDF draw: one uniform number per token keeps a seeded request reproducible
    cdf = np.cumsum(probs)                                                                    # [V]
    # rng.random() < 1, so u < cdf[-1] and the index is a real token (no clamp needed to stay in range)
    return int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))


def sample_step(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
                seen: Sequence[int] = (), sampler=None) -> tuple[list[int], list | None]:
    """One row [V] without a grammar: ([the token], [token_logprobs(...)] if params.logprobs asks, else None)."""
    token = (sampler or sample)(logits, params, rng, seen=seen)
    return [token], None if params.logprobs is None else [token_logprobs(logits, token, params.logprobs)]


def token_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The sampled token's log-probability and the k most likely (id, log-probability), best first.

    The model's own distribution (log-softmax of the raw logits [V]), not the one temperature, top-p or penalties
    drew from: the number then means the same whatever the sampling settings (vLLM's default too)."""
    x = logits.astype(np.float64)                                                             # [V]
    best = _check_best(x.max())
    logz = best + math.log(np.exp(x - best).sum())
    top = np.argpartition(-x, k)[:k] if k < x.shape[-1] else np.arange(x.shape[-1])                  # [k]
    top = top[np.argsort(-x[top], kind="stable")]
    return float(x[token] - logz), [(int(i), float(x[i] - logz)) for i in top]
