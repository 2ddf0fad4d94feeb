"""Lesson 6: drafters — cheap guesses of the next k tokens, which the target model then checks in one forward.

Every drafter answers one question: given the sequence so far (prompt + output; its last token is not yet in the
target's KV cache), what are probably the next k tokens, and with which probabilities q did you pick them (for
stochastic verification)? A drafter can be wrong as often as it likes: verification keeps the output exactly the
target's. Its quality only decides the speed-up, through the acceptance rate α.

    NgramDrafter   prompt lookup: find the latest earlier occurrence of the last few tokens in the request's own
                   context and propose what followed it. No model, ~free; wins when the answer quotes the prompt
                   (extraction, code edits, repeated structure), proposes nothing elsewhere.
    ModelDrafter   any cheaper Model with the target's vocabulary, run autoregressively on its own KV cache:
                   - early_exit_model(target, L'): the first L' layers of the target + its final norm and LM head
                     (self-speculative: no second set of weights);
                   - an int8 copy of the target (lesson 7's ts.load_model(path, quant="int8")).

A drafter object belongs to one request (a ModelDrafter holds that request's draft KV cache); `make_drafter`
builds a fresh one per request.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

import numpy as np

from .config import check_positive_int
from .kv_cache import KVCache, forward_with_cache
from .model import Model
from .sampling import SamplingParams, probabilities, sample


@dataclass(slots=True)
class Draft:
    tokens: list[int]                   # [k'] proposed tokens, k' <= k (a drafter may find fewer, even none)
    probs: np.ndarray | None = None     # [k', V] q: the distribution each token was drawn from; None means the
                                        # drafter is deterministic (q is one-hot on its token)

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    name: str
    cost: float      # drafting one token, relative to one target decode step (the adaptive k weighs it)

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> Draft: ...


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from an unnormalised [V] distribution, by one uniform number (inverse CDF, as sampling.sample)."""
    cdf = np.cumsum(probs)                                                        # [V]
    assert cdf[-1] > 0, "cannot draw from an all-zero distribution"
    return int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))


# --- (a) prompt lookup -----------------------------------------------------------------------------------------

@dataclass(slots=True)
class NgramDrafter:
    """Propose the continuation of the latest earlier occurrence of the context's last n tokens (n = max_n down
    to min_n: a longer match is better evidence)."""
    max_n: int = 3
    min_n: int = 1
    name: str = "ngram"
    cost: float = 0.0   # a few vectorised compares over the context: nothing next to a forward

    def __post_init__(self) -> None:
        check_positive_int("min_n", self.min_n, "NgramDrafter")
        check_positive_int("max_n", self.max_n, "NgramDrafter")
        if self.min_n > self.max_n:
            raise ValueError(f"NgramDrafter: need min_n <= max_n, got {self.min_n} > {self.max_n}")

    def propose(self, context: Sequence[int], k: int, params: SamplingParams | None = None,
                rng: np.random.Generator | None = None) -> Draft:
        ctx = np.asarray(context, dtype=np.int64)                                 # [T]
        T = len(ctx)
        for n in range(min(self.max_n, T - 1), self.min_n - 1, -1):
            # windows starting at i = 0 .. T-1-n: each has a next token ctx[i+n] that the match would predict;
            # the suffix itself (i = T-n) is excluded because nothing follows it yet
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:T - 1], n)   # [T-n, n]
            hits = np.flatnonzero((windows == ctx[T - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n     # the most recent occurrence: local repetition is the best guide
                return Draft(ctx[start:start + k].tolist())
        return Draft([])


# --- (b), (c) a smaller model ---------------------------------------------------------------------------------

def early_exit_model(model: Model, n_layers: int) -> Model:
    """The first n_layers layers of `model` with its own final norm and tied LM head: a draft model that shares
    every weight with the target (self-speculative decoding). Nothing is copied."""
    L = model.config.n_layers
    if not isinstance(n_layers, (int, np.integer)) or isinstance(n_layers, bool) or not 1 <= n_layers <= L:
        raise ValueError(f"early exit needs a layer count in [1, {L}], got {n_layers!r}")
    return replace(model, config=replace(model.config, n_layers=int(n_layers)), layers=model.layers[:n_layers])


@dataclass(slots=True)
class ModelDrafter:
    """Draft with any Model that shares the target's vocabulary, on a KV cache of its own.

    Before each proposal the draft cache is synchronised with the context by comparing tokens: the longest common
    prefix stays cached (rejected draft tokens are rewound), whatever the target accepted or corrected since is
    run through the draft model in one catch-up forward. So the drafter needs no callback from verification, and
    it survives anything the caller does to the sequence (preemption and recompute included).
    """
    model: Model
    name: str = "draft"
    cost: float | None = None         # default: the draft's share of the weights a decode step reads
    target: Model | None = None       # given: checked for a shared vocabulary (and used for the default cost)
    cache: KVCache | None = None
    cached: list[int] = field(default_factory=list)   # the tokens whose draft K/V are in `cache`, in order

    def __post_init__(self) -> None:
        if self.target is not None and self.target.config.vocab_size != self.model.config.vocab_size:
            raise ValueError(f"draft model vocabulary ({self.model.config.vocab_size}) differs from the target's "
                             f"({self.target.config.vocab_size}): its tokens would mean something else")
        if self.cost is None:
            # bandwidth-bound decode reads every weight once per token, so the parameter ratio is the time ratio
            self.cost = (self.model.num_parameters() / self.target.num_parameters()) if self.target else 1.0

    def _sync(self, context: Sequence[int]) -> np.ndarray:
        """Bring the cache to hold exactly `context`; return the draft's logits [V] for the token after it."""
        m = min(len(self.cached), len(context) - 1)   # at least one token must run, to get the next logits
        a = np.asarray(self.cached[:m])
        b = np.asarray(context[:m])
        diff = np.flatnonzero(a != b)
        keep = int(diff[0]) if diff.size else m                           # longest common prefix
        need = len(context) + 1
        if self.cache is None or self.cache.max_len < need:
            self._grow(need)
        self.cache.rewind(self.cache.length - keep)
        del self.cached[keep:]
        logits = forward_with_cache(self.model, self.cache, context[keep:])[0]   # [V] catch-up, last row only
        self.cached.extend(int(t) for t in context[keep:])
        return logits

    def _grow(self, need: int) -> None:
        # grow by doubling (a copy) instead of reserving the whole context window per request
        cfg = self.model.config
        size = min(cfg.max_seq_len, max(256, 2 * need))
        new = KVCache.allocate(cfg, size)
        if self.cache is not None:
            n = self.cache.length
            new.k[:, :n], new.v[:, :n], new.length = self.cache.k[:, :n], self.cache.v[:, :n], n
        self.cache = new

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> Draft:
        k = min(k, self.model.config.max_seq_len - len(context))   # the draft model's own window
        if k <= 0:
            return Draft([])
        logits = self._sync(context)                                                  # [V]
        penalised = params.repetition_penalty != 1.0
        seen = list(context) if penalised else []
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        for i in range(k):
            if params.greedy:
                tok = sample(logits, params, rng, seen=seen)        # argmax: no random number used
            else:
                q = probabilities(logits, params, seen)                                # [V]
                tok = draw(q, rng)
                qs.append(q)
            tokens.append(tok)
            if penalised:
                seen.append(tok)
            if i + 1 < k:   # the last draft token needs no forward: nothing is drafted after it
                logits = forward_with_cache(self.model, self.cache, [tok])[0]         # [V]
                self.cached.append(tok)
        return Draft(tokens, np.stack(qs) if qs else None)


KINDS = ("ngram", "early-exit", "int8", "draft")


def make_drafter(kind: str, target: Model, draft_model: Model | None = None,
                 early_exit_layers: int | None = None) -> Drafter:
    """A fresh drafter for one request. kind: "ngram"; "early-exit" (first `early_exit_layers` layers of the
    target, default 4/5 of them: on SmolLM2 fewer layers agree with the full model too rarely to be worth their
    cost, which the tied LM head keeps high anyway); "int8" or "draft" (draft_model, e.g. the int8 copy)."""
    if kind == "ngram":
        return NgramDrafter()
    if kind == "early-exit":
        layers = early_exit_layers or max(1, 4 * target.config.n_layers // 5)
        return ModelDrafter(early_exit_model(target, layers), name=f"early-exit-{layers}", target=target)
    if kind in ("int8", "draft"):
        if draft_model is None:
            raise ValueError(f"the {kind!r} drafter needs a draft model (e.g. ts.load_model(path, quant='int8'))")
        return ModelDrafter(draft_model, name=kind, target=target)
    raise ValueError(f"unknown drafter {kind!r}: choose one of {', '.join(KINDS)}")
