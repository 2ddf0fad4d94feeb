"""Lesson 6 inside the Engine: drafting before the schedule, verification after the shared forward.

The Engine is given how its steps decode (`step_strategy`): a `Speculator` built from a `SpecConfig`, or, with
speculation off, `OneTokenSteps`, which answers the same calls with nothing to do, so `Engine.step` is the same code
either way. With a Speculator every request gets its own `SpecState` (sequence.py). A decoding request with a drafter
appends its draft to output_ids for the length of one step, so the scheduler, the block manager and the batch
(step_batch.py) see one ordinary chunk of k + 1 rows; the forward returns logits for all of them; `Speculator.verify`
keeps the accepted prefix plus the target's own token, rewinds the rest (blocks left empty go back to the pool) and
only then lets the block manager publish blocks, so a block holding an unverified token never reaches the prefix
trie. Between steps no request holds a draft.

The Speculator changes sequences and their blocks, never the Engine's queues: what fails or finishes it reports
back (a `Verdict`, or the failures of `draft_all`), and the Engine retires the request.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .block_manager import BlockManager
from .config import check_positive_int
from .drafters import Draft, Drafter, make_drafter
from .kv_sizing import max_kv_positions
from .model import Model
from .sequence import Sequence, SpecState
from .speculative import AdaptiveK, SpecStats, draft_length, verify


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """How the Engine speculates (Engine(..., speculative=SpecConfig(...)), or the same fields as keywords)."""
    drafter: str | Callable[[], Drafter]   # "ngram" | "early-exit" | "int8"/"draft" (with draft_model), or a
                                           # function returning a fresh Drafter, called once per request
    draft_k: int = 4                       # tokens drafted per step (the maximum when adaptive_k)
    adaptive_k: bool = False               # pick k per step from the measured acceptance (speculative.AdaptiveK)
    draft_model: Model | None = None       # the drafter's model, for "int8"/"draft"
    verify_costs: tuple[float, ...] | None = None   # [k_max + 1] measured verify costs, as for AdaptiveK

    def __post_init__(self):
        check_positive_int("draft_k", self.draft_k, "Engine")
        if self.verify_costs is not None:
            object.__setattr__(self, "verify_costs", tuple(self.verify_costs))   # frozen: a list would be shared

    @classmethod
    def of(cls, speculative, **options) -> SpecConfig | None:
        """The Engine's `speculative` argument and its keyword options (draft_k=..., ...) as one SpecConfig."""
        if isinstance(speculative, cls):
            if options:
                raise TypeError(f"give {', '.join(options)} inside the SpecConfig, not next to it")
            return speculative
        if speculative is None:
            if options:
                raise ValueError(f"{', '.join(options)} given without speculative=...: nothing would draft")
            return None
        return cls(speculative, **options)


def step_strategy(model: Model, speculative, **options) -> OneTokenSteps | Speculator:
    """How the Engine's steps decode, from its `speculative` argument (SpecConfig.of): OneTokenSteps when it is
    None, else a Speculator."""
    config = SpecConfig.of(speculative, **options)
    return OneTokenSteps() if config is None else Speculator(model, config)


class OneTokenSteps:
    """The step without speculation: no request drafts, each samples one token from its last row. It answers the
    Speculator's calls with nothing to do, so the Engine's step is one piece of code with or without lesson 6."""

    def __init__(self):
        self.stats = SpecStats()               # stays empty: nothing is drafted

    def attach(self, seq: Sequence) -> None:
        pass

    def draft_all(self, running: Iterable[Sequence], blocks: BlockManager) -> list[tuple[Sequence, Exception]]:
        return []

    @staticmethod
    def fit_drafts(scheduled: list[tuple[Sequence, int]], queued: Iterable[Sequence]) -> None:
        pass

    def record(self, seq: Sequence, drafted: int, accepted: int, emitted: int) -> None:
        pass

    def verify(self, seq: Sequence, n: int, logits: np.ndarray, now: float, blocks: BlockManager) -> Verdict:
        raise AssertionError("a draft to verify, but this engine does not speculate")


class Verdict(NamedTuple):
    """What verifying one request's draft did. The Engine turns it into that request's StepOutput."""
    tokens: list[int]                 # appended to output_ids: the accepted drafts + the target's token, to the stop
    done: bool                        # the stop rule fired inside them
    error: Exception | None = None    # verification or the stop rule raised: the request fails, keeping `tokens`


class Speculator:
    """Drafts for every decoding request before the schedule and verifies the drafts after the forward."""

    def __init__(self, model: Model, config: SpecConfig):
        self.config = config
        self.max_seq_len = model.config.max_seq_len
        if isinstance(config.drafter, str):
            kind = config.drafter
            self.make_drafter = lambda: make_drafter(kind, model, config.draft_model)   # noqa: E731
            self.make_drafter()                # a bad kind or a missing draft model fails here, not per request
        else:
            self.make_drafter = config.drafter
        self.stats = SpecStats()               # all requests together (each request has its own in .spec.stats)

    def attach(self, seq: Sequence) -> None:
        """A new request gets its own drafter (a model drafter holds a KV cache), stats and k controller."""
        if seq.params.logprobs is not None:      # a verified draft's tokens are not sampled one by one
            raise ValueError("logprobs are not reported with speculative decoding: serve without it")
        cfg = self.config
        drafter = self.make_drafter()
        seq.spec = SpecState(drafter, SpecStats(),
                             AdaptiveK(cfg.draft_k, drafter.cost, cfg.verify_costs) if cfg.adaptive_k else None)

    def record(self, seq: Sequence, drafted: int, accepted: int, emitted: int) -> None:
        """Count one target forward of `seq` in its own stats and in the engine's total."""
        if seq.spec is None:                   # (an engine's requests all have one; a stand-alone call may not)
            return
        for stats in (seq.spec.stats, self.stats):
            stats.record(drafted, accepted)
            stats.emitted += emitted

    def draft_all(self, running: Iterable[Sequence], blocks: BlockManager) -> list[tuple[Sequence, Exception]]:
        """Every decoding request proposes its next k tokens. They join the end of its output_ids as provisional
        tokens, so the scheduler, the block manager and the batch see one ordinary chunk of k + 1 rows (the last
        sampled token + the draft); `verify` keeps what the target agrees with. A draft only takes blocks the pool
        has spare: speculation must never push another request out. Returns the requests whose drafter raised
        (each ends alone; the Engine fails them)."""
        failed = []
        spare = blocks.num_free
        for seq in list(running):
            seq.drop_draft()                # (a step interrupted by Ctrl-C may have left one)
            if seq.spec is None or not seq.is_decoding:
                continue
            # never more positions than the request may ever hold (what add_request checked the pool against)
            room = max_kv_positions(len(seq.prompt_ids), seq.stopper.max_new_tokens, self.max_seq_len) \
                - seq.num_tokens
            k = draft_length(self.config.draft_k, seq.spec.k_control, len(seq.output_ids),
                             seq.stopper.max_new_tokens, room)
            base = blocks.blocks_needed(seq, 1)
            while k > 0 and blocks.blocks_needed(seq, 1 + k) - base > spare:
                k -= 1
            if k == 0:
                continue
            try:
                draft = seq.spec.drafter.propose(seq.prompt_ids + seq.output_ids, k, seq.params, seq.rng)
            except Exception as e:            # a broken drafter ends its own request, not the batch
                failed.append((seq, e))
                continue
            if seq.constraint is not None:      # structured output: verify only what the grammar allows
                n = seq.constraint.valid_prefix(draft.tokens)
                draft = Draft(draft.tokens[:n], draft.probs[:n] if draft.probs is not None else None)
            if not draft.tokens:
                continue
            spare -= blocks.blocks_needed(seq, 1 + len(draft)) - base
            seq.spec.draft, seq.spec.draft_probs = list(draft.tokens), draft.probs
            seq.output_ids.extend(seq.spec.draft)
        return failed

    @staticmethod
    def fit_drafts(scheduled: list[tuple[Sequence, int]], queued: Iterable[Sequence]) -> None:
        """After scheduling: a draft keeps only the rows its request was given (the token budget may cut it), and a
        queued request that was not scheduled (or was preempted) drops its draft."""
        given = {seq.request_id: n for seq, n in scheduled}
        for seq in queued:
            if not seq.num_drafted:
                continue
            n = given.get(seq.request_id, 0)
            if n == 0:
                seq.drop_draft()
            elif n < 1 + seq.num_drafted:
                spec = seq.spec
                del seq.output_ids[-(seq.num_drafted - (n - 1)):]
                spec.draft = spec.draft[:n - 1]
                spec.draft_probs = spec.draft_probs[:n - 1] if spec.draft_probs is not None else None

    def verify(self, seq: Sequence, n: int, logits: np.ndarray, now: float, blocks: BlockManager) -> Verdict:
        """The forward ran seq's last sampled token + its draft (n = k + 1 rows, logits [k + 1, V]): keep the
        accepted prefix plus the target's own next token, rewind the rest, publish only verified blocks, stop
        exactly where plain decoding would (the stop rule sees the new tokens one by one)."""
        spec = seq.spec
        draft = Draft(spec.draft, spec.draft_probs)
        seq.drop_draft()                            # output_ids: the verified tokens only
        try:
            if seq.constraint is not None:          # row i is masked by the grammar's state after draft[:i]
                logits = seq.constraint.apply_rows(logits, draft.tokens)
            new = verify(logits, draft, seq.params, seq.rng, seq.prompt_ids + seq.output_ids)
        except Exception as e:
            return Verdict([], True, e)
        accepted = len(new) - 1
        seq.num_computed_tokens += n                      # K/V of the last token and of all k drafts ...
        blocks.rewind(seq, len(draft) - accepted)         # ... minus the rejected ones
        kept: list[int] = []
        done = False
        try:
            for token in new:
                seq.output_ids.append(token)
                seq.token_times.append(now)
                kept.append(token)
                if seq.constraint is not None:
                    seq.constraint.advance(token)
                if seq.stopper.should_stop(seq.output_ids):
                    done = True
                    break
        except Exception as e:
            return Verdict(kept, True, e)
        # stopped inside the accepted run: the K/V of the tokens cut off go too (cache = every token but the newest)
        blocks.rewind(seq, max(0, seq.num_computed_tokens - (seq.num_tokens - 1)))
        assert seq.num_computed_tokens == seq.num_tokens - 1, "after verification the cache holds all but the newest"
        blocks.commit(seq)                                # only now: every computed position is verified
        self.record(seq, len(draft), accepted, len(kept))
        if spec.k_control is not None:
            spec.k_control.update(len(draft), accepted)
        return Verdict(kept, done)
