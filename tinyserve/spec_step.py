"""Lesson 6 inside the Engine: drafting before the schedule, verification after the shared forward.

A decoding request with a drafter appends its draft to output_ids for the length of one step, so the scheduler,
the block manager and the batch (step_batch.py) see one ordinary chunk of k + 1 rows; the forward returns logits
for all of them; `verify_draft` keeps the accepted prefix plus the target's own token, rewinds the rest (blocks
left empty go back to the pool) and only then lets the block manager publish blocks, so a block holding an
unverified token never reaches the prefix trie. Between steps no request holds a draft.
"""
from __future__ import annotations

import numpy as np

from .drafters import Draft, make_drafter
from .kv_sizing import max_kv_positions
from .sequence import Sequence
from .speculative import AdaptiveK, SpecStats, draft_length, verify


def setup(engine, model, speculative, draft_k: int, adaptive_k: bool, draft_model, verify_costs) -> None:
    """Engine(..., speculative=...): a drafter kind ("ngram", "early-exit", "int8"/"draft" with draft_model) or
    a function returning a fresh Drafter (one per request)."""
    from .config import check_positive_int
    if isinstance(speculative, str):
        kind = speculative
        speculative = lambda: make_drafter(kind, model, draft_model)   # noqa: E731
        speculative()                          # a bad kind or a missing draft model fails here, not per request
    engine.make_drafter = speculative          # None: every request decodes one token per step
    engine.draft_k = check_positive_int("draft_k", draft_k, "Engine")
    engine.adaptive_k = adaptive_k
    engine.verify_costs = tuple(verify_costs) if verify_costs is not None else None
    engine.spec_stats = SpecStats()            # all requests together (each Sequence has its own in .spec)


def attach(engine, seq: Sequence) -> Sequence:
    """A new request gets its own drafter (a model drafter holds a KV cache), stats and k controller."""
    if engine.make_drafter is not None:
        seq.drafter, seq.spec = engine.make_drafter(), SpecStats()
        if engine.adaptive_k:
            seq.k_control = AdaptiveK(engine.draft_k, seq.drafter.cost, engine.verify_costs)
    return seq


def draft_all(engine) -> list:
    """Every decoding request with a drafter proposes its next k tokens. They join the end of its output_ids
    as provisional tokens, so the scheduler, the block manager and the batch see one ordinary chunk of k + 1
    rows (the last sampled token + the draft); `verify_draft` keeps what the target agrees with. A draft only
    takes blocks the pool has spare: speculation must never push another request out."""
    failed = []
    spare = engine.blocks.num_free
    for seq in list(engine.running):
        drop_draft(seq)                 # (a step interrupted by Ctrl-C may have left one)
        if seq.drafter is None or not seq.is_decoding:
            continue
        # never more positions than the request may ever hold (what add_request checked the pool against)
        room = max_kv_positions(len(seq.prompt_ids), seq.stopper.max_new_tokens, engine.config.max_seq_len) \
            - seq.num_tokens
        k = draft_length(engine.draft_k, seq.k_control, len(seq.output_ids), seq.stopper.max_new_tokens, room)
        base = engine.blocks.blocks_needed(seq, 1)
        while k > 0 and engine.blocks.blocks_needed(seq, 1 + k) - base > spare:
            k -= 1
        if k == 0:
            continue
        try:
            draft = seq.drafter.propose(seq.prompt_ids + seq.output_ids, k, seq.params, seq.rng)
        except Exception as e:                # a broken drafter ends its own request, not the batch
            failed.append(engine._fail(seq, e))
            continue
        if not draft.tokens:
            continue
        spare -= engine.blocks.blocks_needed(seq, 1 + len(draft)) - base
        seq.draft, seq.draft_probs = list(draft.tokens), draft.probs
        seq.output_ids.extend(seq.draft)
    return failed

def fit_drafts(engine, scheduled: list[tuple[Sequence, int]]) -> None:
    """After scheduling: a draft keeps only the rows its request was given (the token budget may cut it), and a
    request that was not scheduled (or was preempted) drops its draft."""
    given = {seq.request_id: n for seq, n in scheduled}
    for seq in (*engine.running, *engine.waiting):
        if not seq.draft:
            continue
        n = given.get(seq.request_id, 0)
        if n == 0:
            drop_draft(seq)
        elif n < 1 + len(seq.draft):
            cut = len(seq.draft) - (n - 1)
            del seq.output_ids[-cut:]
            seq.draft = seq.draft[:n - 1]
            seq.draft_probs = seq.draft_probs[:n - 1] if seq.draft_probs is not None else None

def drop_draft(seq: Sequence) -> None:
    if seq.draft:
        del seq.output_ids[-len(seq.draft):]
        seq.draft, seq.draft_probs = [], None

def verify_draft(engine, seq: Sequence, n: int, logits: np.ndarray, now: float):
    """The forward ran seq's last sampled token + its draft (n = k + 1 rows, logits [k + 1, V]): keep the
    accepted prefix plus the target's own next token, rewind the rest, publish only verified blocks, stop
    exactly where plain decoding would (the stop rule sees the new tokens one by one)."""
    draft, probs = seq.draft, seq.draft_probs
    drop_draft(seq)                             # output_ids: the verified tokens only
    try:
        new = verify(logits, Draft(draft, probs), seq.params, seq.rng, seq.prompt_ids + seq.output_ids)
    except Exception as e:
        return engine._fail(seq, e)
    accepted = len(new) - 1
    seq.num_computed_tokens += n                      # K/V of the last token and of all k drafts ...
    engine.blocks.rewind(seq, len(draft) - accepted)    # ... minus the rejected ones
    kept: list[int] = []
    done = False
    try:
        for token in new:
            seq.output_ids.append(token)
            seq.token_times.append(now)
            kept.append(token)
            if seq.stopper.should_stop(seq.output_ids):
                done = True
                break
    except Exception as e:
        return engine._fail(seq, e, kept)
    # stopped inside the accepted run: the K/V of the tokens cut off go too (cache = every token but the newest)
    engine.blocks.rewind(seq, max(0, seq.num_computed_tokens - (seq.num_tokens - 1)))
    assert seq.num_computed_tokens == seq.num_tokens - 1, "after verification the cache holds all but the newest"
    engine.blocks.commit(seq)                           # only now: every computed position is verified
    for stats in (seq.spec, engine.spec_stats):
        stats.record(len(draft), accepted)
        stats.emitted += len(kept)
    if seq.k_control is not None:
        seq.k_control.update(len(draft), accepted)
    if done:
        engine._finish(seq)
    from .engine import StepOutput   # (engine imports this module)
    return StepOutput(seq.request_id, kept, done, seq.finish_reason)


