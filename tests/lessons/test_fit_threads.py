"""course.fit_threads: BLAS and Numba run on the cores other programs leave free. A fake load stands in for
/proc/stat, so each case can fail: a wrong rounding, a zero-thread choice, a count that is not applied."""
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from tinyserve import backend, course


@pytest.mark.parametrize("load, cores, threads", [
    (0.0, 2, 2), (0.3, 2, 2),          # a browser's flicker leaves both cores
    (0.5, 2, 1), (1.0, 2, 1), (1.4, 2, 1),   # one busy loop holds one core
    (1.6, 2, 1), (3.0, 2, 1),          # more load than cores: still one thread, never zero
    (1.0, 8, 7), (2.6, 8, 5), (0.0, 1, 1),
])
def test_choose_threads_leaves_the_held_cores(load, cores, threads):
    assert course.choose_threads(load, cores) == threads


@pytest.mark.parametrize("load, cores", [(-0.1, 2), (float("nan"), 2), (1.0, 0)])
def test_choose_threads_refuses_nonsense(load, cores):
    with pytest.raises(ValueError, match="choose_threads"):
        course.choose_threads(load, cores)


@pytest.fixture
def restore():
    blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    saved = (course._fitted, backend.NUMBA_THREADS)
    yield
    course._fitted, backend.NUMBA_THREADS = saved
    threadpool_limits(limits=max(blas) if blas else None, user_api="blas")


def test_fit_threads_applies_the_count_and_says_why(monkeypatch, capsys, restore):
    monkeypatch.delenv(course.THREADS_ENV, raising=False)
    monkeypatch.setattr(course.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(course, "other_load", lambda seconds=0.5: 1.0)     # one busy loop beside us
    t = course.fit_threads(refresh=True)
    assert (t.threads, t.busy, t.source) == (1, 1, "load")
    assert "2 cores, 1 busy with other programs" in capsys.readouterr().out
    assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} <= {1}
    assert backend.NUMBA_THREADS == 1
    monkeypatch.setattr(course, "other_load", lambda seconds=0.5: 0.1)     # quiet now: refresh takes both cores
    assert course.fit_threads(refresh=True).threads == 2
    assert backend.NUMBA_THREADS in (1, 2)      # (a Numba already started on one thread keeps its pool's size)
    assert course.fit_threads(refresh=False).threads == 2, "decided once per notebook unless refreshed"


def test_a_run_of_the_course_passes_one_count(monkeypatch, restore):
    monkeypatch.setenv(course.THREADS_ENV, "1")
    monkeypatch.setattr(course, "other_load", lambda seconds=0.5: pytest.fail("a run's count is not re-sampled"))
    t = course.fit_threads(refresh=True, quiet=True)
    assert (t.threads, t.source) == (1, course.THREADS_ENV)
    monkeypatch.setenv(course.THREADS_ENV, "two")
    with pytest.raises(ValueError, match=course.THREADS_ENV):
        course.fit_threads(refresh=True, quiet=True)


def test_the_machine_probe_is_taken_again_on_another_thread_count(tmp_path, monkeypatch, restore):
    monkeypatch.setattr(course, "_machine_path", lambda: tmp_path / "machine.json")
    monkeypatch.setenv(course.RUN_ENV, "run-t")
    monkeypatch.setenv(course.THREADS_ENV, "1")
    course.fit_threads(refresh=True, quiet=True)
    one = course.machine(rounds=1)
    assert one.threads == 1 and course.machine() == one
    monkeypatch.setenv(course.THREADS_ENV, "2")
    course.fit_threads(refresh=True, quiet=True)
    two = course.machine(rounds=1)
    assert two.threads == min(2, course.os.cpu_count()) and two.measured_at >= one.measured_at
    if two.threads == 2:
        assert two != one, "a probe taken on 1 thread must not be reused for 2"
