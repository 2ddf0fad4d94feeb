"""The learner switch (TINYSERVE_SOLUTION=learner, tinyserve/course.py): with a fully solved exercises file for every
lesson, the key function of each lesson's notebook runs on the learner's functions, and gives the reference's output.

The "solved" files re-export the reference functions through thin wrappers that count their calls, so the test
sees that the learner's code (not the reference behind it) is what the engine calls. Tiny model: fast.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

import tinyserve as ts
from tinyserve import course, kv_cache, naive
from tinyserve.sampling import SamplingParams


def solved_file(lesson: int, folder: Path) -> Path:
    """An exercises file whose every exercise is implemented: a wrapper around the reference that logs its calls."""
    lines = ["CALLS = []", ""]
    for name, target in course.exercise_table(lesson).items():
        module, _, attr = target.partition(":")
        lines.append(f"from {module} import {attr} as _reference_{name}")
        if isinstance(getattr(importlib.import_module(module), attr), type):
            lines += [f"class {name}(_reference_{name}):",
                      "    def __init__(self, *args, **kwargs):",
                      f"        CALLS.append({name!r})",
                      "        super().__init__(*args, **kwargs)", ""]
        else:
            lines += [f"def {name}(*args, **kwargs):",
                      f"    CALLS.append({name!r})",
                      f"    return _reference_{name}(*args, **kwargs)", ""]
    path = folder / f"solved_{lesson:02d}.py"
    path.write_text("\n".join(lines))
    return path


@pytest.fixture
def solved(tmp_path):
    files = {n: solved_file(n, tmp_path) for n in course.course_lessons()}   # every lesson, 6-9 too
    with course.use_learner_code(list(files), files, quiet=True) as switch:
        calls = {n: sys.modules[f"tinyserve_learner_exercises_{n:02d}"].CALLS for n in files}
        yield switch, calls


def test_stubs_are_not_used(tmp_path):
    stubs = course.course_lessons()
    with course.use_learner_code([1, 4], {n: stubs[n] for n in (1, 4)}, quiet=True) as switch:
        assert switch.used == {}, "the committed stubs implement nothing: the reference must keep running"
        assert set(switch.pending[4]) == {"BlockAllocator", "slot_mapping", "plan_step"}
    banner = switch.banner()
    assert "still the reference" in banner and "lesson 4" in banner


def test_a_file_that_does_not_import_keeps_the_reference_and_says_so(tmp_path):
    broken = tmp_path / "exercises.py"
    broken.write_text("def plan_step(:\n")
    with course.use_learner_code([4], {4: broken}, quiet=True) as switch:
        assert 4 in switch.broken and "SyntaxError" in switch.broken[4]
        assert switch.used == {} and ts.scheduler.plan_step.__module__ == "tinyserve.scheduler"
        assert "DOES NOT IMPORT" in switch.banner()


def test_every_solved_exercise_is_switched_and_restored(solved, tiny):
    switch, calls = solved
    for n in (1, 2, 3, 4, 5):
        assert switch.used[n] == list(course.exercise_table(n)), f"lesson {n}: every exercise is implemented"
    assert ts.scheduler.plan_step.__module__ == "tinyserve_learner_exercises_04"
    assert ts.engine.plan_step is ts.scheduler.plan_step, "the Engine looks plan_step up in its own module"
    switch.restore()
    assert ts.scheduler.plan_step.__module__ == "tinyserve.scheduler"
    assert kv_cache.forward_with_cache.__module__ == "tinyserve.kv_cache"


def test_lessons_1_to_3_generate_text_on_the_learner_code(solved, tiny):
    switch, calls = solved
    ids = [5, 17, 99, 3, 42]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_new_tokens=12, ignore_eos=True)
    out_naive = naive.generate(tiny, ids, params=sampled)                  # lesson 1's notebook
    out_kv = kv_cache.generate(tiny, ids, params=sampled)                  # lesson 2's notebook
    streamed = list(kv_cache.generate_stream(tiny, ids, params=sampled))   # the CLI's --strategy kv
    assert {"rms_norm", "apply_rope", "softmax", "causal_attention", "top_p_filter"} <= set(calls[1])
    assert {"generate", "forward_with_cache", "append_kv", "rectangular_mask"} <= set(calls[2])
    assert "grouped_attention" in calls[3], "the KV-cache path attends with lesson 3's grouped_attention"
    switch.restore()
    assert out_naive == naive.generate(tiny, ids, params=sampled)
    assert out_kv == streamed == kv_cache.generate(tiny, ids, params=sampled)


def test_lessons_4_and_5_the_engine_runs_the_learner_allocator_scheduler_and_trie(solved, tiny):
    switch, calls = solved
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(3, 256, 24)]
    prompts = [shared + [int(t) for t in rng.integers(3, 256, n)] for n in (3, 9, 5, 14)]
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    engine = ts.Engine(tiny, num_blocks=24, block_size=4, max_batch_tokens=32, prefix_caching=True)
    others = [[int(t) for t in rng.integers(3, 256, 40)] for _ in range(2)]          # fill the pool: evictions
    run = lambda e: e.generate(prompts, greedy) + e.generate(others, greedy) + e.generate(prompts[:1], greedy)  # noqa: E731
    out = run(engine)
    assert {"BlockAllocator", "slot_mapping", "plan_step"} <= set(calls[4])
    assert {"match_prefix", "insert", "evict_lru", "block_hashes"} <= set(calls[5])
    switch.restore()
    ref = ts.Engine(tiny, num_blocks=24, block_size=4, max_batch_tokens=32, prefix_caching=True)
    assert out == run(ref)
    assert engine.blocks.cache.stats.evicted_blocks == ref.blocks.cache.stats.evicted_blocks > 0
