"""tools/bench_serve.py (make bench-serve) and tools/peers/build_llama_server.py without servers or a build: the
arrivals, the length mix, the percentiles and the SLO verdicts, the held rate and its ratio, guidellm's report read
back, the recorded table, and the build script's options."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyserve.loadgen import poisson_arrivals

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod          # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


bs = _load("bench_serve", ROOT / "tools" / "bench_serve.py")
bls = _load("build_llama_server", ROOT / "tools" / "peers" / "build_llama_server.py")


# --- arrivals and the workload -----------------------------------------------------------------------------------

def test_poisson_arrivals_start_at_zero_increase_and_have_the_rate():
    t = poisson_arrivals(4000, rate=4.0, seed=1)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    # exponential gaps: mean 1/rate and standard deviation 1/rate (a constant-rate schedule has sd 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.06)
    assert gaps.std() == pytest.approx(0.25, rel=0.08)
    assert np.array_equal(t, poisson_arrivals(4000, rate=4.0, seed=1))       # seeded: both servers get the same
    assert not np.array_equal(t, poisson_arrivals(4000, rate=4.0, seed=2))


@pytest.mark.parametrize("n, rate", [(0, 1.0), (5, 0.0), (5, -1.0), (5, float("nan"))])
def test_poisson_arrivals_refuse_nonsense(n, rate):
    with pytest.raises(ValueError):
        poisson_arrivals(n, rate)


def test_workload_is_the_same_for_every_server_and_has_the_bench_mix():
    st = bs.Settings(rates=(2.0,), seconds=30, min_requests=16)
    assert st.num_requests(2.0) == 60 and st.num_requests(0.1) == 16       # the floor keeps a p90 meaningful
    (r1, a1), (r2, a2) = bs.workload(st, 2.0, vocab_size=1000), bs.workload(st, 2.0, vocab_size=1000)
    assert [r.prompt for r in r1] == [r.prompt for r in r2] and np.array_equal(a1, a2)
    assert all(32 <= len(r.prompt) <= 256 and 16 <= r.max_tokens <= 96 and r.ignore_eos for r in r1)
    (r3, _) = bs.workload(st, 2.0, vocab_size=1000, salt=1)                # another rate: other requests
    assert [r.prompt for r in r3] != [r.prompt for r in r1]


def test_length_mix_matches_the_uniform_range():
    m = bs.length_mix(32, 256)
    assert m == {"mean": 144, "stdev": 65, "min": 32, "max": 256}
    u = np.arange(16, 97)
    m = bs.length_mix(16, 96)
    assert m["mean"] == round(u.mean()) and m["stdev"] == round(u.std()) and (m["min"], m["max"]) == (16, 96)
    with pytest.raises(ValueError):
        bs.length_mix(10, 5)


def test_guidellm_scenario_asks_for_the_right_load(tmp_path):
    st = bs.Settings(rates=(1.0, 3.0), seconds=20, min_requests=8, seed=7)
    sc = bs.guidellm_scenario("http://127.0.0.1:9", "m", 3.0, st.num_requests(3.0), st, tmp_path, tmp_path / "o.json",
                              salt=2)["spec"]
    assert sc["backend"]["request_format"] == "/v1/completions" and sc["backend"]["target"] == "http://127.0.0.1:9"
    assert sc["profile"] == {"kind": "poisson", "rate": [3.0]}
    assert sc["constraints"] == [{"kind": "max_requests", "count": 60}]
    d = sc["data"][0]
    assert (d["prompt_tokens_min"], d["prompt_tokens_max"], d["output_tokens_min"], d["output_tokens_max"]) == \
        (32, 256, 16, 96)
    assert sc["seed"]["value"] == 9


def test_rates_are_parsed_and_checked():
    assert bs.parse_rates("0.5, 1,2") == (0.5, 1.0, 2.0)
    for bad in ("", "1,x", "0,1", "2,1", "1,1", "-1", "inf"):
        with pytest.raises(ValueError):
            bs.parse_rates(bad)


@pytest.mark.parametrize("argv", [["--rates", "2,1"], ["--servers", "vllm"], ["--seconds", "0"], ["--threads", "0"],
                                  ["--slo-itl", "-1"]])
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bs.parse_args(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_quick_and_default_settings():
    a = bs.parse_args([])
    assert a.settings.rates == bs.DEFAULT_RATES and a.settings.slo_ttft == 1.0 and a.settings.slo_itl == 0.1
    assert a.servers == [bs.TINY, bs.LLAMA] and a.client == "builtin" and a.settings.threads == 2
    q = bs.parse_args(["--quick"]).settings
    assert q.rates == bs.QUICK_RATES and q.seconds == 10 and q.min_requests == 8


def test_servers_take_turns_first():
    assert [bs.server_order(i)[0] for i in range(4)] == [bs.TINY, bs.LLAMA, bs.TINY, bs.LLAMA]


# --- percentiles, SLO and the held rate --------------------------------------------------------------------------

def _rec(ttft, itl, n=None, ok=True):
    n = n or len(itl) + 1
    return bs.RequestRecord(ok, n, ttft, ttft + sum(itl), list(itl), None if ok else "HTTP 429")


def test_summarize_pools_every_gap_and_skips_failures():
    recs = [_rec(0.1, [0.01] * 9), _rec(0.3, [0.05]), _rec(5.0, [], n=0, ok=False)]
    s = bs.summarize(recs, seconds=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["requests_per_s"] == 1.0 and s["output_tokens_per_s"] == (10 + 2) / 2.0
    assert s["ttft_p50_ms"] == pytest.approx(200.0)                  # the failed request's 5 s is not a TTFT
    # ten gaps pooled: nine of 10 ms and one of 50 ms (a per-request mean would give 10 and 50 at equal weight)
    assert s["itl_p50_ms"] == pytest.approx(10.0) and s["itl_p99_ms"] > 10.0
    assert s["tpot_p50_ms"] == pytest.approx(30.0)                    # (10 + 50) / 2
    assert s["e2e_p90_ms"] == pytest.approx(334.0)                   # 190 and 350 ms, linear between them


def test_an_empty_summary_fails_the_slo():
    s = bs.summarize([_rec(0.1, [], n=0, ok=False)], seconds=1.0)
    assert math.isnan(s["ttft_p90_ms"])
    met, why = bs.slo_verdict(s, 1.0, 0.1)
    assert not met and any("failed" in w for w in why) and any("TTFT" in w for w in why)


def test_slo_verdict_checks_each_bound():
    base = {"requests": 10, "failed": 0, "ttft_p90_ms": 900.0, "itl_p90_ms": 99.0}
    assert bs.slo_verdict(base, 1.0, 0.1) == (True, [])
    assert bs.slo_verdict({**base, "ttft_p90_ms": 1001.0}, 1.0, 0.1)[0] is False
    assert bs.slo_verdict({**base, "itl_p90_ms": 101.0}, 1.0, 0.1)[0] is False
    met, why = bs.slo_verdict({**base, "failed": 1}, 1.0, 0.1)
    assert not met and why == ["1 of 10 requests failed"]
    assert bs.slo_verdict({**base, "ttft_p90_ms": 1001.0}, 2.0, 0.1)[0] is True     # the bound is the option's


def _rows(server, verdicts):
    return [{"rate": r, "server": server, "slo_met": m} for r, m in verdicts]


def test_held_rate_stops_at_the_first_miss():
    rows = _rows(bs.TINY, [(0.5, True), (1, True), (2, False), (3, True)]) + _rows(bs.LLAMA, [(0.5, True),
                                                                                            (1, False), (2, False)])
    assert bs.held_rate(rows, bs.TINY) == 1           # the pass at 3 after a miss at 2 is noise, not capacity
    assert bs.held_rate(rows, bs.LLAMA) == 0.5
    assert bs.held_ratio(rows, top_rate=3) == {bs.TINY: 1, bs.LLAMA: 0.5, "ratio": 2.0, "note": ""}


def test_held_ratio_at_the_sweeps_edges():
    none = _rows(bs.LLAMA, [(1, False), (2, False)])
    assert bs.held_rate(none, bs.LLAMA) == 0
    h = bs.held_ratio(_rows(bs.TINY, [(1, True), (2, False)]) + none, top_rate=2)
    assert h["ratio"] is None and "llama-server holds no rate" in h["note"]
    h = bs.held_ratio(_rows(bs.TINY, [(1, True), (2, True)]) + _rows(bs.LLAMA, [(1, True), (2, False)]), top_rate=2)
    assert h["ratio"] == 2.0 and "lower bound" in h["note"]
    h = bs.held_ratio(_rows(bs.TINY, [(1, True), (2, True)]), top_rate=2)          # --servers tinyserve
    assert h["ratio"] is None and h["note"] == "llama-server not run"


def test_summary_from_guidellm_reads_its_percentiles():
    def dist(p50, p90, p99, total=0.0, count=4):
        return {"successful": {"count": count, "total_sum": total,
                               "percentiles": {"p50": p50, "p90": p90, "p99": p99}}}
    bench = {"duration": 4.0, "metrics": {
        "request_totals": {"successful": 4, "errored": 1, "incomplete": 0, "total": 5},
        "output_token_count": dist(50, 90, 96, total=200.0),
        "time_to_first_token_ms": dist(100.0, 300.0, 400.0), "inter_token_latency_ms": dist(20.0, 40.0, 60.0),
        "time_per_output_token_ms": dist(21.0, 41.0, 61.0), "request_latency": dist(1.5, 2.5, 3.0)}}
    s = bs.summary_from_guidellm(bench)
    assert (s["requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["requests_per_s"] == 1.0 and s["output_tokens_per_s"] == 50.0
    assert (s["ttft_p90_ms"], s["itl_p90_ms"], s["tpot_p99_ms"]) == (300.0, 40.0, 61.0)
    assert s["e2e_p50_ms"] == 1500.0                  # guidellm's request latency is in seconds
    assert bs.slo_verdict(s, 1.0, 0.1)[0] is False    # the errored request breaks the SLO


# --- the record ------------------------------------------------------------------------------------------------

def _result(when, t_held, l_held, ratio, note=""):
    summary = {"requests": 16, "completed": 16, "failed": 0, "seconds": 10.0, "requests_per_s": 1.6,
               "output_tokens_per_s": 90.0, **{f"{k}_p{q}_ms": 10.0 for k in ("ttft", "itl", "tpot", "e2e")
                                                for q in (50, 90, 99)}}
    return {"time": when + " UTC", "commit": "abc1234", "cpu": {"model": "Test CPU"}, "llama_format": "IQ4_NL",
            "settings": {"threads": 2, "rates": [1.0, 2.0], "slo_ttft": 1.0, "slo_itl": 0.1},
            "held": {bs.TINY: t_held, bs.LLAMA: l_held, "ratio": ratio, "note": note},
            "rows": [{"rate": 1.0, "server": bs.TINY, "summary": summary, "slo_met": True, "slo_why": []},
                     {"rate": 2.0, "server": bs.LLAMA, "summary": summary, "slo_met": False,
                      "slo_why": ["p90 TTFT 1500 ms > 1000"]}],
            "load_average": {"start": [0.5, 0, 0], "end": [1.5, 0, 0]}}


def test_recorded_runs_make_the_table_newest_first(tmp_path):
    bs.record_run(_result("2026-12-01 10:00", 2.0, 1.0, 2.0), tmp_path)
    bs.record_run(_result("2026-12-03 09:30", 2.0, 2.0, 1.0, "tinyserve holds the sweep's top rate: the ratio is a "
                                                               "lower bound"), tmp_path)
    assert sorted(p.name for p in (tmp_path / "bench-serve").glob("*.json")) == \
        ["2026-12-01-1000-t2.json", "2026-12-03-0930-t2.json"]
    text = bs.write_table(tmp_path).read_text()
    assert "Do not edit by hand" in text
    held = [line for line in text.splitlines() if line.startswith("| 2026-")]
    assert held[0].startswith("| 2026-12-03 09:30") and "1.00x (≥)" in held[0]
    assert held[1].startswith("| 2026-12-01 10:00") and "2.00x" in held[1] and "(≥)" not in held[1]
    assert "✗ p90 TTFT 1500 ms > 1000" in text and "✓" in text
    assert "IQ4_NL" in held[0] and "TTFT ≤ 1000 ms, ITL ≤ 100 ms" in held[0]


def test_llama_server_command_has_the_fair_settings(tmp_path):
    cmd = bs.llama_command(tmp_path / "llama-server", tmp_path / "m.gguf", 8123, threads=2, slots=32,
                           ctx_per_slot=416)
    opts = dict(zip(cmd[1::2], cmd[2::2]))
    assert opts["-t"] == opts["-tb"] == "2" and opts["-np"] == "32" and opts["-c"] == str(32 * 416)
    assert "--cont-batching" in cmd and opts["--host"] == "127.0.0.1" and opts["--port"] == "8123"


# --- the build script ---------------------------------------------------------------------------------------------

AMX_CPUINFO = "processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n"
ZEN4_CPUINFO = "processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni avx512_bf16\n"


def test_amx_is_read_from_the_flags_line_only():
    assert bls.cpu_has_amx(AMX_CPUINFO)
    assert not bls.cpu_has_amx(ZEN4_CPUINFO)
    assert not bls.cpu_has_amx("model name\t: amx_tile lookalike\nflags\t\t: fpu amx_tile_x\n")


def test_plan_switches_amx_off_only_where_it_is():
    amx, zen = dict(bls.make_plan(cpuinfo=AMX_CPUINFO, jobs=2).options), dict(bls.make_plan(cpuinfo=ZEN4_CPUINFO,
                                                                                              jobs=2).options)
    assert amx["CMAKE_C_FLAGS"] == amx["CMAKE_CXX_FLAGS"] == "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    assert "CMAKE_C_FLAGS" not in zen
    for opts in (amx, zen):
        assert opts["LLAMA_BUILD_SERVER"] == "ON" and opts["LLAMA_CURL"] == "OFF"
        assert opts["CMAKE_BUILD_TYPE"] == "Release" and opts["GGML_NATIVE"] == "ON"
        assert opts["LLAMA_USE_PREBUILT_UI"] == "OFF"    # no download at build time


def test_plan_options_and_their_errors():
    p = bls.make_plan(cpuinfo="", jobs=3, extra=["GGML_NATIVE=OFF", "FOO_BAR="])
    assert dict(p.options)["GGML_NATIVE"] == "OFF" and dict(p.options)["FOO_BAR"] == "" and p.jobs == 3
    for bad in (["GGML_NATIVE"], ["=ON"], ["A B=1"]):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            bls.make_plan(extra=bad)
    with pytest.raises(ValueError, match="jobs"):
        bls.make_plan(jobs=0)
    assert bls.main(["--cmake-option", "oops", "--print-cmake"]) == 2


def test_commands_build_the_one_target(tmp_path):
    plan = bls.make_plan(cpuinfo=ZEN4_CPUINFO, jobs=2)
    configure, build = bls.cmake_commands(plan, "cmake", tmp_path / "src", tmp_path / "b")
    assert configure[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "b")]
    assert "-DLLAMA_BUILD_SERVER=ON" in configure and "-DCMAKE_BUILD_TYPE=Release" in configure
    assert build == ["cmake", "--build", str(tmp_path / "b"), "--target", "llama-server", "-j", "2"]


def test_the_stamp_makes_a_second_run_do_nothing(tmp_path, capsys):
    plan = bls.make_plan(cpuinfo=ZEN4_CPUINFO, jobs=2)
    assert not bls.is_built(tmp_path, plan)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").write_text("")
    assert not bls.is_built(tmp_path, plan)                 # a binary without a stamp: built by whom, how?
    (tmp_path / "build-stamp.json").write_text(json.dumps({"key": plan.key()}))
    assert bls.is_built(tmp_path, plan)
    assert bls.is_built(tmp_path, bls.make_plan(cpuinfo=ZEN4_CPUINFO, jobs=7))      # jobs do not change the binary
    assert not bls.is_built(tmp_path, bls.make_plan(cpuinfo=AMX_CPUINFO, jobs=2))   # other flags do
    assert not bls.is_built(tmp_path, bls.make_plan(version="0.3.35", cpuinfo=ZEN4_CPUINFO))
    (tmp_path / "build-stamp.json").write_text("not json")
    assert not bls.is_built(tmp_path, plan)


def test_print_cmake_names_the_install_path(tmp_path, capsys):
    assert bls.main(["--print-cmake", "--prefix", str(tmp_path), "--jobs", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == str(tmp_path / "bin" / "llama-server")
    assert out[1].endswith("--target llama-server -j 2")


def test_default_prefix_follows_the_cache_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path))
    assert bls.default_prefix("1.2.3") == tmp_path / "llama-server-1.2.3"
