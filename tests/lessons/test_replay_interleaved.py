"""queueing.replay_interleaved: lesson 8's refined TTFT prediction, a trace replayed through the scheduler on paper.
Each expected value is worked out by hand from the interleaved rules (decodes first, prompts oldest first in the
rest of the budget, at most max_running), so a replay that ignores the budget queue or the slots fails."""
import pytest

from tinyserve import queueing

STEP, PER_TOKEN = 0.1, 0.01                     # s per decode step (any batch), s per prompt token


def replay(arrivals, prompts, outputs, **kw):
    return queueing.replay_interleaved(arrivals, prompts, outputs, lambda B: STEP, PER_TOKEN, **kw)


def test_a_lone_prompt_takes_one_step_of_its_own_tokens():
    assert replay([0.0], [10], [3]) == pytest.approx([10 * PER_TOKEN])


def test_a_prompt_waits_behind_the_chunks_of_the_one_ahead():
    # step 1: prompt A's 60 tokens + 4 of B's (0.64 s); step 2: A's decode + B's last 56 (0.1 + 0.56 s)
    assert replay([0.0, 0.0], [60, 60], [3, 3]) == pytest.approx([0.64, 1.30])


def test_a_newcomer_waits_for_a_slot_when_max_running_are_running():
    # 10 prompts of 10 at once, 8 slots: 6 whole prompts + 4 tokens of the 7th in step 1 (0.64 s); step 2: 6 decodes,
    # the 7th's last 6 tokens and the 8th's 10 (0.1 + 0.16 s); the last two wait until two requests finish
    got = replay([0.0] * 10, [10] * 10, [5] * 10, max_running=8)
    assert got[:6] == pytest.approx([0.64] * 6) and got[6:8] == pytest.approx([0.90] * 2)
    assert min(got[8:]) > 0.90 + 2 * STEP, "with every slot taken, a newcomer must wait for a request to finish"


def test_an_arrival_mid_step_joins_at_the_next_step():
    # A's prompt runs 0 .. 0.2 s; B arrives at 0.05 and joins the step after: A's decode + B's 10 tokens
    got = replay([0.0, 0.05], [20, 10], [4, 2])
    assert got == pytest.approx([0.2, 0.2 + STEP + 10 * PER_TOKEN - 0.05])


def test_refuses_a_trace_it_cannot_replay():
    with pytest.raises(ValueError, match="replay_interleaved"):
        queueing.replay_interleaved([0.0, 1.0], [10], [3, 3], lambda B: STEP, PER_TOKEN)
    with pytest.raises(ValueError, match="replay_interleaved"):
        queueing.replay_interleaved([1.0, 0.0], [10, 10], [3, 3], lambda B: STEP, PER_TOKEN)


def test_the_replay_schedules_as_the_engine_does():
    """The real Engine (tiny model) on a virtual clock that charges each step what the replay charges it: every
    request's first token must come at the time the replay says. A replay whose schedule drifts from the engine's
    scheduler (admission, chunking, slots) fails here whatever the step costs."""
    import numpy as np
    import tinyserve as ts
    from tinyserve import orchestrators as orch
    from tinyserve.engine import Engine

    model = ts.tiny_model(seed=0)
    trace = orch.poisson_trace(8.0, 16, (16, 96), (4, 10), model.config.vocab_size, seed=3)
    step = lambda B: 0.02 + 0.01 * B                                                      # noqa: E731
    engine = Engine(model, num_blocks=256, block_size=16, max_batch_tokens=64, max_running=4)
    t, nxt, first, ids = 0.0, 0, {}, {}
    while nxt < len(trace) or engine.has_unfinished():
        while nxt < len(trace) and trace[nxt].arrival <= t:
            ids[engine.add_request(trace[nxt].prompt, orch.greedy_params(trace[nxt]))] = nxt
            nxt += 1
        if not engine.has_unfinished():
            t = trace[nxt].arrival
            continue
        outputs = engine.step()
        s = engine.stats[-1]
        t += (step(s.num_decode) if s.num_decode else 0.0) + PER_TOKEN * (s.num_tokens - s.num_decode)
        for out in outputs:
            if out.new_tokens and ids[out.request_id] not in first:
                first[ids[out.request_id]] = t - trace[ids[out.request_id]].arrival
            if out.finished:
                engine.pop_finished(out.request_id)
    got = queueing.replay_interleaved([r.arrival for r in trace], [len(r.prompt) for r in trace],
                                      [r.max_tokens for r in trace], step, PER_TOKEN, token_budget=64, max_running=4)
    assert np.allclose(got, [first[i] for i in range(len(trace))], atol=1e-9)
    assert max(got) > 2 * min(got), "the trace must make some requests queue, or the check proves little"
