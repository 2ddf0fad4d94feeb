"""The first run's compile (tinyserve/jit.py): never timed as the model, announced, and off the first answer's path.

All on the tiny model. The real compile is not run here (tens of seconds): a fake child stands in for it, and the
warm-up is replaced where a test is about who waits, not about Numba."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import numpy as np
import pytest

from tinyserve import jit, kv_cache
from tinyserve.__main__ import main
from tinyserve.backend import set_backend
from tinyserve.sampling import SamplingParams
from tinyserve.weights import tiny_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
PROMPT = [5, 9, 40, 41, 42, 100, 7, 3, 60]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory for the stamps and lock files (Numba's own cache stays where it is)."""
    monkeypatch.setattr(jit, "cache_dir", lambda: tmp_path)
    return tmp_path


def test_stand_in_is_the_int8_model_in_numpy():
    """The stand-in multiplies by the dequantized int8 weights: the int8 reference's logits within float order."""
    ref = set_backend(tiny_model(seed=0), "int8", "numpy")
    si = jit.stand_in(set_backend(tiny_model(seed=0), "int8", "numba"))
    assert si.backend == "numpy" and si.quant == "none" and all(w.wq.dtype == np.float32 for w in si.layers)
    a, b = (kv_cache.prefill(m, kv_cache.KVCache.allocate(m.config, 16), PROMPT) for m in (ref, si))
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    f32 = tiny_model(seed=0)   # and not the float32 model: int8 rounding moves the logits by far more
    c = kv_cache.prefill(f32, kv_cache.KVCache.allocate(f32.config, 16), PROMPT)
    assert np.abs(c - a).max() > 100 * np.abs(b - a).max()


def test_become_switches_a_request_between_two_tokens():
    """Stand-in for the first 4 tokens, then the same object becomes the fast model: the request goes on from its
    K/V cache and gives the tokens the fast path gives alone."""
    fast = set_backend(tiny_model(seed=0), "int8", "numba")
    alone = kv_cache.generate(fast, PROMPT, 12, GREEDY)
    model = jit.stand_in(set_backend(tiny_model(seed=0), "int8", "numba"))
    out = []
    for tok in kv_cache.generate_stream(model, PROMPT, 12, GREEDY):
        out.append(tok)
        if len(out) == 4:
            assert model.backend == "numpy"
            jit.become(model, fast)
    assert model.backend == "numba" and model.quant == "int8"
    assert out == alone


def test_the_stamp_says_warm_only_for_what_was_compiled(cache):
    assert not jit.is_warm("int8", "kv")
    (cache / "tinyserve-warm-int8-kv.json").write_text(json.dumps(jit.cache_key("int8", "kv")))
    assert jit.is_warm("int8", "kv")
    assert not jit.is_warm("w8a8", "kv") and not jit.is_warm("int8", "engine")
    stale = jit.cache_key("int8", "kv") | {"numba": "0.0.1"}            # another numba compiles again
    (cache / "tinyserve-warm-int8-kv.json").write_text(json.dumps(stale))
    assert not jit.is_warm("int8", "kv")
    (cache / "tinyserve-warm-int8-kv.json").write_text("{half a file")
    assert not jit.is_warm("int8", "kv")


def test_warm_up_rejects_a_path_without_kernels():
    with pytest.raises(ValueError, match="int8, w8a8, w8a8-64, w4a8 or gguf"):
        jit.warm_up("none")
    with pytest.raises(ValueError, match="workload"):
        jit.warm_up("int8", "paged")


def test_background_compile_runs_once_and_reports_done(cache):
    argv = [sys.executable, "-c", "import time; print('[1/1] pretend: 0.4 s', flush=True); time.sleep(0.4)"]
    a = jit.BackgroundCompile("int8", "kv", argv=argv)
    assert a.proc is not None and (cache / "tinyserve-compiling-int8-kv.pid").exists()
    b = jit.BackgroundCompile("int8", "kv", argv=["false"])   # a second process waits for the same child
    assert b.proc is None and b.pid == a.pid
    assert not a.done()
    lines = []
    assert a.wait(log=lines.append) is False                  # the child wrote no stamp: not warm
    assert lines == ["[1/1] pretend: 0.4 s"] and a.seconds >= 0.4
    assert b.wait() is False and b.done()
    assert not (cache / "tinyserve-compiling-int8-kv.pid").exists()


def fake_compile(monkeypatch, cache, seconds: float):
    """A background 'compile' that sleeps and then writes the stamp; warm_up (the in-process load) is a no-op."""
    stamp = cache / "tinyserve-warm-int8-kv.json"
    code = (f"import time, pathlib; time.sleep({seconds}); "
            f"pathlib.Path({str(stamp)!r}).write_text({json.dumps(json.dumps(jit.cache_key('int8', 'kv')))})")
    monkeypatch.setattr(jit, "compile_argv", lambda quant, workload: [sys.executable, "-c", code])


def run_json(capsys, *args) -> tuple[dict, str]:
    assert main(["generate", "--model", "tiny", "--json", "--temperature", "0", *args, "hello"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_compiling_first_is_announced_and_not_counted_in_ttft(cache, monkeypatch, capsys):
    """--compile wait: the compile (a 1.5 s stand-in) is announced, reported, and not inside TTFT or tokens/s."""
    def slow_warm_up(quant, workload="kv", log=None):
        time.sleep(1.5)
        return 1.5
    monkeypatch.setattr(jit, "warm_up", slow_warm_up)
    out, err = run_json(capsys, "--compile", "wait", "--max-new-tokens", "8")
    assert f"compiling the int8 kernels for this CPU (first run only, ~{jit.ESTIMATE_S['kv']} s)" in err
    assert jit.estimate_s("w4a8", "kv") > jit.estimate_s("int8", "kv")      # its 4-bit tiles compile besides
    assert out["kernels"]["how"] == "compiled" and 1.5 <= out["kernels"]["seconds"] < 2.5   # + packing the weights
    assert out["ttft_s"] < 1.0 and out["total_s"] < 1.0
    assert (out["quant"], out["backend"]) == ("int8", "numba")


def test_a_warm_cache_is_loaded_before_the_clock_starts(cache, monkeypatch, capsys):
    (cache / "tinyserve-warm-int8-kv.json").write_text(json.dumps(jit.cache_key("int8", "kv")))
    monkeypatch.setattr(jit, "warm_up", lambda quant, workload="kv", log=None: time.sleep(1.2) or 1.2)
    out, err = run_json(capsys, "--max-new-tokens", "8")
    assert out["kernels"]["how"] == "cache" and out["ttft_s"] < 1.0
    assert "compiling" not in err


@pytest.mark.parametrize("warm", [True, False])
def test_the_weights_are_packed_for_the_kernels_before_anything_is_timed(cache, monkeypatch, warm):
    """Packing (kernels/forward.prepare) is part of loading: left to the first forward, the first request's prefill
    paid for it and the fast path's TTFT was longer than the NumPy stand-in's."""
    if warm:
        (cache / "tinyserve-warm-int8-kv.json").write_text(json.dumps(jit.cache_key("int8", "kv")))
    monkeypatch.setattr(jit, "warm_up", lambda quant, workload="kv", log=None: 0.0)
    fast = set_backend(tiny_model(seed=0), "int8", "numba")
    assert fast.fast is None
    model, k = jit.prepare(fast, "kv", False, log=lambda line: None)
    assert model is fast and model.fast is not None and k.how == ("cache" if warm else "compiled")


def test_cold_start_returns_with_the_answer_and_the_next_run_is_fast(cache, monkeypatch, capsys):
    """Background (the default): the first token does not wait for the 'compile' (3 s), and neither does the end of
    the process: the answer (8 tokens) is done long before, so generate returns, names the compile's log, and the
    compile goes on by itself; the run after it finds the cache warm."""
    fake_compile(monkeypatch, cache, 3.0)
    monkeypatch.setattr(jit, "warm_up", lambda quant, workload="kv", log=None: 0.0)
    t0 = time.perf_counter()
    out, err = run_json(capsys, "--max-new-tokens", "8")
    assert time.perf_counter() - t0 < 3.0, "generate waited for the compile"
    log = cache / "tinyserve-compile-int8-kv.log"
    assert f"the kernels go on compiling in the background (first run only, log: {log})" in err
    k = out["kernels"]
    assert k["how"] == "background" and k["seconds"] is None and k["numpy_tokens"] == 8
    assert k["fast_ttft_s"] is None and "compiled" not in out["timeline_s"]
    pid = int((cache / "tinyserve-compiling-int8-kv.pid").read_text())
    deadline = time.time() + 60
    while not jit.is_warm("int8", "kv"):                          # the compile outlives the answer, and ends
        assert time.time() < deadline, "the background compile did not finish on its own"
        time.sleep(0.1)
    with contextlib.suppress(ChildProcessError):                  # our child here (after `make run` the shell's
        os.waitpid(pid, 0)                                        # init reaps it): reap it
    out, err = run_json(capsys, "--max-new-tokens", "8")
    assert out["kernels"]["how"] == "cache" and "compiling" not in err


def test_compile_finish_answers_on_numpy_then_measures_the_fast_path(cache, monkeypatch, capsys):
    """--compile finish: the first token does not wait for the 'compile' (2 s); the answer (8 tokens) is done long
    before, so the process waits for the compile and replays the answer on the fast path."""
    fake_compile(monkeypatch, cache, 2.0)
    monkeypatch.setattr(jit, "warm_up", lambda quant, workload="kv", log=None: 0.0)
    t0 = time.perf_counter()
    out, err = run_json(capsys, "--max-new-tokens", "8", "--compile", "finish")
    assert time.perf_counter() - t0 >= 2.0                        # it waited for the compile to finish
    assert "in the background; the answer starts on the NumPy path" in err
    assert out["ttft_s"] < 1.0 and out["total_s"] < 1.0
    k = out["kernels"]
    assert k["how"] == "background" and k["seconds"] >= 2.0 and k["numpy_tokens"] == 8
    assert k["fast_ttft_s"] > 0 and k["fast_tokens_per_s"] > 0
    t = out["timeline_s"]          # seconds since the process started: the answer came before the compiler
    assert t["compile_started"] <= t["ready"] <= t["first_token"] <= t["answer_done"] < t["compiled"] <= t["replayed"]
    greedy = kv_cache.generate(set_backend(tiny_model(seed=0), "int8", "numba"), out["prompt_ids"], 8,
                               SamplingParams(temperature=0, max_new_tokens=8))
    assert out["output_ids"] == greedy                            # the stand-in gave the fast path's tokens


def test_a_long_answer_moves_to_the_fast_path_within_itself(cache, monkeypatch, capsys):
    fake_compile(monkeypatch, cache, 0.5)
    monkeypatch.setattr(jit, "warm_up", lambda quant, workload="kv", log=None: 0.0)

    def slow_stand_in(fast):      # a stand-in slow enough (10 ms a token) that the compile ends mid-answer
        si = stand_in(fast)
        si.layers[0].attn_norm = _Slow(si.layers[0].attn_norm)
        return si
    stand_in = jit.stand_in
    monkeypatch.setattr(jit, "stand_in", slow_stand_in)
    out, err = run_json(capsys, "--max-new-tokens", "300")
    k = out["kernels"]
    assert 0 < k["numpy_tokens"] < 300 and k["fast_tokens_per_s"] is None
    assert out["output_ids"] == kv_cache.generate(set_backend(tiny_model(seed=0), "int8", "numba"),
                                                  out["prompt_ids"], 300, SamplingParams(temperature=0,
                                                                                         max_new_tokens=300))


class _Slow(np.ndarray):
    """A norm weight that takes 10 ms to read: makes the NumPy path slow without changing a number."""
    def __new__(cls, a):
        return np.asarray(a).view(cls)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        time.sleep(0.01)
        inputs = tuple(np.asarray(x) if isinstance(x, _Slow) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)


def test_the_summary_line_says_where_the_time_went(cache, monkeypatch, capsys):
    fake_compile(monkeypatch, cache, 0.3)
    monkeypatch.setattr(jit, "warm_up", lambda quant, workload="kv", log=None: 0.0)
    assert main(["generate", "--model", "tiny", "--max-new-tokens", "6", "--compile", "finish", "hello"]) == 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "on the NumPy path while the kernels compiled (compiled in the background in" in err
    assert "the fast path, measured once compiled on the same tokens: TTFT" in err
    (cache / "tinyserve-warm-int8-kv.json").unlink()
    fake_compile(monkeypatch, cache, 2.0)
    assert main(["generate", "--model", "tiny", "--max-new-tokens", "6", "hello"]) == 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    log = cache / "tinyserve-compile-int8-kv.log"
    assert f"on the NumPy path while the kernels compiled (still compiling, first run only; log: {log})" in err


def test_bench_compiles_before_it_times_and_says_so(cache, monkeypatch, capsys):
    monkeypatch.setattr(jit, "warm_up", lambda quant, workload="kv", log=None: 0.7)
    assert main(["bench", "--model", "tiny", "--requests", "2", "--prompt-len", "4", "--output-len", "2",
                 "--sweep", "", "--num-blocks", "16", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "compiling the int8 kernels for this CPU" in out and "kernels: compiled in 0.7 s (not timed)" in out
    assert out.index("kernels: compiled") < out.index("out tok/s")


def test_use_model_moves_an_engine_to_the_fast_path_between_steps():
    from tinyserve.engine import Engine
    fast = set_backend(tiny_model(seed=0), "int8", "numba")
    alone = Engine(fast, num_blocks=16, block_size=4).generate([PROMPT], GREEDY)[0]
    e = Engine(jit.stand_in(set_backend(tiny_model(seed=0), "int8", "numba")), num_blocks=16, block_size=4)
    rid = e.add_request(PROMPT, GREEDY)
    e.step(), e.step()                    # the prompt's prefill and a decode step on the NumPy path
    assert e.backend == "numpy"
    jit.use_model(e, fast)
    while e.has_unfinished():
        e.step()
    assert e.backend == "numba" and e.finished[rid].output_ids == alone
    with pytest.raises(ValueError, match="another config"):
        jit.use_model(e, tiny_model(seed=0, n_layers=3))


def test_the_stand_in_runs_blas_on_one_thread_until_the_switch(cache, monkeypatch):
    from threadpoolctl import threadpool_info
    blas = lambda: [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]   # noqa: E731
    before = blas()
    fake_compile(monkeypatch, cache, 0.2)
    monkeypatch.setattr(jit, "warm_up", lambda quant, workload="kv", log=None: 0.0)
    model, k = jit.prepare(set_backend(tiny_model(seed=0), "int8", "numba"), "kv", True, log=lambda line: None)
    assert k.how == "background" and set(blas()) == {1}
    assert k.bg.wait()
    k.switch(model, 3)                          # loads the kernels and packs the weights: seconds, not 0
    assert k.switched_at == 3 and model.backend == "numba" and model.fast is not None
    assert blas() == before


def test_one_switch_moves_a_model_or_an_engine(cache, monkeypatch):
    """generate swaps the stand-in Model in place, chat and serve swap the Engine's model: one Kernels.switch."""
    from tinyserve.engine import Engine
    fake_compile(monkeypatch, cache, 0.2)
    monkeypatch.setattr(jit, "warm_up", lambda quant, workload="kv", log=None: 0.0)
    model, k = jit.prepare(set_backend(tiny_model(seed=0), "int8", "numba"), "kv", True, log=lambda line: None)
    engine = Engine(model, num_blocks=16, block_size=4)
    assert engine.backend == "numpy" and k.switch(engine, 0) == 0.0 and k.switched_at is None   # not ready yet
    assert k.bg.wait() and k.ready()
    k.switch(engine, 2)
    assert engine.model is k.fast and engine.backend == "numba" and k.switched_at == 2 and not k.ready()
    assert model.backend == "numpy"            # the stand-in itself was left as it was
