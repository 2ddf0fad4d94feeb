"""tinyserve/measure.py: the one timer, the one summary (median, min-max), what decode and prefill tokens/s count,
the CPU line and the table; and that speed, bench_peers, roofline, speculative and course time with them."""
from __future__ import annotations

import itertools

import pytest

import tinyserve as ts
from tinyserve import course, measure, speed
from tinyserve.measure import Rate, Spread, decode_rate, format_table, time_repeated
from tinyserve.step_batch import StepStats


def test_spread_is_median_and_min_max_and_prints_one_run_alone():
    s = Spread.of([45.0, 10.0, 20.0])
    assert (s.median, s.lo, s.hi, s.n) == (20.0, 10.0, 45.0, 3)
    assert s.fmt(1) == "20.0 (10.0-45.0)" and str(s) == s.fmt() and s.fmt(2, "x") == "20.00x (10.00-45.00)"
    assert Spread.of([3.0]).fmt(0) == "3"
    with pytest.raises(ValueError):
        Spread.of([])


def test_time_repeated_times_after_warmup_and_resets_outside_the_timing():
    ticks = itertools.count()                       # a clock that advances 1 s per reading
    calls, resets = [], []
    clock = lambda: float(next(ticks))              # noqa: E731
    s = time_repeated(lambda: calls.append(1), repeat=3, warmup=2, reset=lambda: resets.append(clock()),
                      clock=clock)
    assert len(calls) == 5 and len(resets) == 5     # warm-up calls run (and reset) too
    assert (s.n, s.median, s.lo, s.hi) == (3, 1.0, 1.0, 1.0)   # the reset's own clock reading is not timed
    with pytest.raises(ValueError):
        time_repeated(lambda: None, repeat=0)


def _step(seqs, tokens, decode, sampled, seconds):
    return StepStats(num_seqs=seqs, num_tokens=tokens, num_decode=decode, num_sampled=sampled, num_preempted=0,
                     num_admitted=0, blocks_used=0, seconds=seconds)


def test_decode_rate_counts_plain_decode_steps_only():
    steps = [_step(4, 128, 0, 4, 9.0),              # prefill of 4 prompts: not decode
             _step(4, 4, 4, 4, 0.5), _step(4, 4, 4, 4, 1.5),
             _step(1, 5, 0, 3, 7.0),                # a speculative verify step: 5 rows for 1 sequence
             _step(2, 3, 1, 2, 4.0)]                # one decode beside a prefill chunk
    r = decode_rate(steps)
    assert (r.tokens, r.seconds, r.tokens_per_s) == (8, 2.0, 4.0)
    with pytest.raises(ValueError):
        decode_rate(steps[:1])


def test_speed_workloads_on_the_tiny_model(tiny):
    prompts = [[3, 7, 11, 5], [9, 4, 2, 8]]
    rate, tokens = speed.decode_run(tiny, prompts, new_tokens=5)
    assert rate.tokens == 2 * 4 and rate.seconds > 0 and all(len(t) == 5 for t in tokens)
    greedy = ts.SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    assert tokens == [ts.kv_cache.generate(tiny, p, 5, greedy) for p in prompts]
    pre, logits = speed.prefill_run(tiny, prompts[0])
    assert isinstance(pre, Rate) and pre.tokens == 4 and logits.shape == (tiny.config.vocab_size,)
    assert speed.decode_tokens_per_s(tiny, 2, prompt_len=4, new_tokens=3) > 0
    assert speed.prefill_tokens_per_s(tiny, 8) > 0


def test_verify_costs_and_median_time_use_the_one_timer(tiny, monkeypatch):
    seen = []
    real = measure.time_repeated

    def spy(fn, repeat=5, warmup=1, **kw):
        seen.append((repeat, warmup, "reset" in kw))
        return real(fn, repeat, warmup, **kw)

    from tinyserve import speculative
    monkeypatch.setattr(speculative, "time_repeated", spy)
    monkeypatch.setattr(course, "time_repeated", spy)
    costs = speculative.measure_verify_costs(tiny, 2, history=8, repeat=2, grid=(0, 2))
    assert len(costs) == 3 and costs[0] == 1.0 and seen == [(2, 1, True), (2, 1, True)]
    assert course.median_time(lambda: None, repeat=3, warmup=0) >= 0 and seen[-1] == (3, 0, False)


def test_cpu_info_reads_the_first_cpu_and_falls_back_on_this_machine():
    text = "model name\t: Xeon\nflags\t\t: fpu avx2 amx_int8\n\nmodel name\t: Other\nflags\t\t: fpu\n"
    assert measure.cpu_info(text) == {"model": "Xeon", "flags": ["avx2", "amx_int8"]}
    assert measure.cpu_info("") == {"model": "unknown", "flags": []}
    zen5 = "processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\nflags\t\t: avx2\n\nmodel\t\t: 9\n"
    assert measure.cpu_info(zen5) == {"model": "AMD EPYC (family 26, model 2)", "flags": ["avx2"]}
    assert measure.cpu_name() and measure.cpu_name() == speed.cpu_name()


def test_table_aligns_text_and_markdown():
    rows = [["workload", "tokens/s"], ["decode B=1", "155.0 (150.0-160.0)"], ["prefill 512", "9.5"]]
    lines = format_table(rows).splitlines()
    assert lines[0] == "workload                tokens/s" and set(lines[1]) == {"-", " "}
    assert lines[3] == "prefill 512                  9.5" and len({len(x) for x in lines}) == 1
    md = format_table(rows, markdown=True).splitlines()
    assert md[0].startswith("| workload ") and md[0].endswith(" tokens/s |") and set(md[1]) == {"|", "-"}
    assert len({len(x) for x in md}) == 1


def test_git_commit_names_the_checkout_or_says_unknown(tmp_path):
    here = measure.git_commit()
    assert here != "unknown" and len(here.removesuffix("-dirty")) >= 7, here   # this repository's short hash
    assert measure.git_commit(tmp_path) == "unknown"                          # not a checkout
