"""The three orchestrator designs over one Engine and one trace: same greedy tokens as the offline Engine, each
design's defining property, and the K/V hand-over between two engines (tiny model, a few seconds in all)."""
from __future__ import annotations

import numpy as np
import pytest

from tinyserve.engine import Engine
from tinyserve.orchestrators import (ModelSpec, adopt_prefilled, greedy_params, poisson_trace,
                                     run_batched, run_disaggregated, run_interleaved)
from tinyserve.roofline import kv_bytes_per_token
from tinyserve.sampling import SamplingParams

from .handover import prefill_and_export


@pytest.fixture(scope="module", autouse=True)
def one_blas_thread():
    from threadpoolctl import threadpool_limits
    with threadpool_limits(1):          # tiny matmuls: a second BLAS thread only adds hand-offs
        yield


@pytest.fixture(scope="module")
def trace():
    return poisson_trace(40.0, 16, (8, 100), (2, 24), vocab_size=256, seed=3)


@pytest.fixture(scope="module")
def reference(tiny, trace):
    return Engine(tiny, num_blocks=512).generate([r.prompt for r in trace], [greedy_params(r) for r in trace])


def test_the_trace_is_the_same_requests_at_every_rate():
    slow, fast = poisson_trace(1.0, 20, seed=5), poisson_trace(4.0, 20, seed=5)
    assert [r.prompt for r in slow] == [r.prompt for r in fast]
    assert [r.max_tokens for r in slow] == [r.max_tokens for r in fast]
    assert np.allclose([r.arrival for r in slow], [4 * r.arrival for r in fast])
    assert slow[0].arrival == 0 and all(a.arrival <= b.arrival for a, b in zip(slow, slow[1:]))
    with pytest.raises(ValueError):
        poisson_trace(0.0, 3)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_new_tokens=12),
                                    SamplingParams(temperature=1.5, top_p=0.9, max_new_tokens=12, seed=11)],
                         ids=["greedy", "seeded"])
def test_kv_handover_continues_exactly_where_prefill_stopped(tiny, params):
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 256, 37)]   # 37: the last block is partial
    got = prefill_and_export(tiny, prompt, params, block_size=8)
    k, v = got.k, got.v
    dec = Engine(tiny, num_blocks=64, block_size=16)          # another block size: the hand-over re-blocks
    rid2 = adopt_prefilled(dec, prompt, params, got.first, k, v, got.seq.rng.bit_generator.state)
    dec.run()
    assert dec.finished[rid2].output_ids == got.expect
    with pytest.raises(ValueError, match="prompt positions"):
        adopt_prefilled(dec, prompt, params, 5, k[:, :3], v[:, :3])


def active_at_first_tokens(result) -> int:
    """The most requests in flight (between their first and last token) at any first-token instant."""
    spans = [(t.token_times[0], t.token_times[-1]) for t in result.timings]
    return max(sum(a <= f <= b for a, b in spans) for f, _ in spans)


def test_batched_decodes_each_batch_to_the_end_before_the_next(tiny, trace, reference):
    r = run_batched(tiny, trace, 40.0, max_batch=4)
    assert [t.tokens for t in r.timings] == reference
    assert active_at_first_tokens(r) <= 4
    assert (r.ttft >= 0).all() and r.tokens_per_s > 0


def test_interleaved_admits_newcomers_at_the_next_step(tiny, trace, reference):
    r = run_interleaved(tiny, trace, 40.0, token_budget=32)
    assert [t.tokens for t in r.timings] == reference
    assert r.kv_bytes_moved == 0 and len(r.itl) == sum(len(x) - 1 for x in reference)


def test_disaggregated_hands_kv_over_and_counts_the_bytes(tiny, trace, reference):
    r = run_disaggregated(ModelSpec("tiny"), trace, 40.0, token_budget=128, blas_threads=1)
    assert [t.tokens for t in r.timings] == reference
    # every request with more than one token moved its prompt's K and V, all layers, float32
    expect = sum(len(q.prompt) for q in trace if q.max_tokens > 1) * kv_bytes_per_token(tiny.config)
    assert r.kv_bytes_moved == expect
    assert (r.ttft >= 0).all()


def test_a_worker_that_dies_fails_the_run_at_once(trace):
    with pytest.raises(RuntimeError, match="exited with code"):
        run_disaggregated(ModelSpec("smollm2", weights="/nonexistent/weights"), trace[:2], 40.0, timeout=120)


def test_compare_designs_bounds_every_design_by_max_batch(monkeypatch):
    """One prediction with max_batch speaks for all three designs only if all three run at most max_batch at once."""
    from tinyserve import orchestrators as orch
    seen = {}

    def fake(design):
        def run(model_or_spec, trace, rate, **kw):
            seen[design] = kw
            timings = [orch.Timing(r.arrival, [r.arrival + 0.1, r.arrival + 0.2], [1, 2]) for r in trace]
            return orch.DesignResult(design, rate, timings, 1.0)
        return run

    for name in ("batched", "interleaved", "disaggregated"):
        monkeypatch.setattr(orch, f"run_{name}", fake(name))
    rows = orch.compare_designs(ModelSpec("tiny"), [2.0], num_requests=4, max_batch=3, token_budget=16)
    assert seen["batched"]["max_batch"] == 3
    assert seen["interleaved"]["max_running"] == 3 and seen["disaggregated"]["max_running"] == 3
    assert [r["offered_tokens_per_s"] for r in rows] == [4.0] * 3, "2 requests/s x 2 tokens each"
    assert all(r["itl_mean_ms"] == pytest.approx(100.0) for r in rows)
    assert "offered_tok/s" in orch.format_rows(rows) and "ttft_p90_ms" in orch.format_rows(rows)
