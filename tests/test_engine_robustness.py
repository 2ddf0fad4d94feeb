"""One bad request never wedges the engine (issue 8): a request that fails while it is served ends alone, with
finish_reason "error" and the message, and gives its blocks back; the rest of the batch carries on. A failure of
the batched forward ends that batch only; Ctrl-C leaves the engine consistent; `abort` frees a request at once.
"""
from __future__ import annotations

import os
import signal

import pytest

from tinyserve import engine as engine_mod
from tinyserve import kv_cache
from tinyserve.engine import Engine, StepOutput
from tinyserve.sampling import SamplingParams

from .test_engine import GREEDY, assert_no_leaks, mixed_prompts


def slipped_past_validation(**fields) -> SamplingParams:
    """SamplingParams holding values that validation now refuses, as an older version accepted them. The issue's
    repro was repetition_penalty=1e-39: it overflowed every seen float32 logit to inf, and step() raised halfway.
    The penalty is now applied in float64 (where 1e-39 is harmless), so 5e-324 stands in for it."""
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def run_collecting(engine: Engine) -> dict[int, list[StepOutput]]:
    outs: dict[int, list[StepOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_request_that_fails_while_sampling_ends_alone(tiny, prefix_caching):
    prompts = mixed_prompts(5, seed=21)
    bad = slipped_past_validation(repetition_penalty=5e-324)
    engine = Engine(tiny, num_blocks=40, block_size=4, max_batch_tokens=32, prefix_caching=prefix_caching)
    ids = [engine.add_request(p, bad if i == 2 else GREEDY) for i, p in enumerate(prompts)]
    outs = run_collecting(engine)                      # used to raise ValueError, then assert "livelock" forever
    last = outs[ids[2]][-1]
    assert last.finished and last.finish_reason == "error" and last.new_tokens == []
    assert "NaN or no finite maximum" in last.error
    assert engine.finished[ids[2]].finish_reason == "error" and engine.finished[ids[2]].error == last.error
    for i, p in enumerate(prompts):
        if i != 2:
            assert engine.finished[ids[i]].output_ids == kv_cache.generate(tiny, p, params=GREEDY)
            assert outs[ids[i]][-1].error is None and outs[ids[i]][-1].finish_reason == "length"
    with pytest.raises(RuntimeError, match="request 5 failed: ValueError"):   # generate never hides a failure
        engine.generate([prompts[0]], bad)
    if prefix_caching:
        engine.blocks.cache.check()
        engine.blocks.cache.clear()
    assert_no_leaks(engine)


def test_a_failing_stop_check_ends_its_request_with_the_token(tiny):
    class BrokenTokenizer:
        def decode(self, ids, skip_special_tokens=False):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    engine = Engine(tiny, num_blocks=40, block_size=4, tokenizer=BrokenTokenizer())
    bad = engine.add_request([5, 6, 7], SamplingParams(temperature=0, stop=("x",), max_new_tokens=5))
    good = engine.add_request([8, 9], GREEDY)
    outs = run_collecting(engine)
    assert [(o.finish_reason, len(o.new_tokens)) for o in outs[bad]] == [("error", 1)]
    assert "UnicodeDecodeError" in outs[bad][0].error
    assert engine.finished[bad].output_ids == outs[bad][0].new_tokens
    assert engine.finished[good].output_ids == kv_cache.generate(tiny, [8, 9], params=GREEDY)
    assert_no_leaks(engine)


def test_a_failing_forward_ends_its_batch_and_the_engine_goes_on(tiny, monkeypatch):
    real, calls = engine_mod.forward, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("pretend the batch did not fit")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "forward", flaky)
    engine = Engine(tiny, num_blocks=40, block_size=4, max_batch_tokens=8, max_running=2)
    prompts = mixed_prompts(4, seed=22, lo=3, hi=12)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    outs = run_collecting(engine)
    failed = [i for i in ids if engine.finished[i].finish_reason == "error"]
    assert failed and all("MemoryError: pretend" in engine.finished[i].error for i in failed)
    assert all(outs[i][-1].finish_reason == "error" for i in failed)
    for i, p in zip(ids, prompts):                     # the requests outside that batch were served as usual
        if i not in failed:
            assert engine.finished[i].output_ids == kv_cache.generate(tiny, p, params=GREEDY)
    assert len(failed) < len(ids)
    assert_no_leaks(engine)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_ctrl_c_in_the_forward_leaves_the_engine_consistent(tiny, monkeypatch, prefix_caching):
    real, calls = engine_mod.forward, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) in (3, 7):
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "forward", interrupted)
    prompts = mixed_prompts(4, seed=23)
    engine = Engine(tiny, num_blocks=30, block_size=4, max_batch_tokens=16, prefix_caching=prefix_caching)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    interrupts = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except KeyboardInterrupt:
            interrupts += 1
    assert interrupts == 2
    for i, p in zip(ids, prompts):                     # nothing lost, nothing computed twice into the output
        assert engine.finished[i].output_ids == kv_cache.generate(tiny, p, params=GREEDY)
    if prefix_caching:
        engine.blocks.cache.clear()
    assert_no_leaks(engine)


def test_ctrl_c_during_the_bookkeeping_is_held_until_it_is_done(tiny, monkeypatch):
    engine = Engine(tiny, num_blocks=30, block_size=4, max_batch_tokens=16)
    real_admit, fired = engine.blocks.admit, []

    def admit(seq):                                    # SIGINT arrives between popping the queue and `running`
        if not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        real_admit(seq)

    monkeypatch.setattr(engine.blocks, "admit", admit)
    prompts = mixed_prompts(3, seed=24)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert len(engine.running) + len(engine.waiting) == 3   # nobody fell between the queues
    engine.run()
    for i, p in zip(ids, prompts):
        assert engine.finished[i].output_ids == kv_cache.generate(tiny, p, params=GREEDY)
    assert_no_leaks(engine)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_abort_frees_a_request_at_once(tiny, prefix_caching):
    prompts = mixed_prompts(4, seed=25, lo=10, hi=30)
    engine = Engine(tiny, num_blocks=40, block_size=4, max_batch_tokens=64, max_running=2,
                    prefix_caching=prefix_caching)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    engine.step()
    running, waiting = engine.running[0], engine.waiting[-1]
    assert running.block_table and not waiting.block_table
    used = engine.blocks.allocator.num_used
    assert engine.abort(running.request_id) is True
    assert engine.blocks.allocator.num_used < used or prefix_caching   # (with the cache, its blocks stay cached)
    assert running.block_table == [] and running.finish_reason == "abort" and running.error is None
    assert engine.finished[running.request_id] is running
    assert engine.abort(waiting.request_id) is True and waiting.finish_reason == "abort"
    assert engine.abort(running.request_id) is False               # already finished
    engine.run()
    for i, p in zip(ids, prompts):
        if i not in (running.request_id, waiting.request_id):
            assert engine.finished[i].output_ids == kv_cache.generate(tiny, p, params=GREEDY)
    assert engine.abort(ids[0]) is False
    engine.pop_finished(ids[0])
    assert engine.abort(ids[0]) is False                           # finished and forgotten: still not an error
    with pytest.raises(KeyError, match="no request 99"):
        engine.abort(99)
    if prefix_caching:
        engine.blocks.cache.clear()
    assert_no_leaks(engine)


def test_step_output_error_defaults_to_none():
    out = StepOutput(3, [7], False, None)
    assert out.error is None and out._fields[-1] == "error"
