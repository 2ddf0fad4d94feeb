"""tools/bench_peers.py (make bench-peers) without the peer venvs: options, the numbers it prints, the worker protocol
against fake workers, and tinyserve's own measurement functions on the tiny model."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tinyserve as ts

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "tools" / "bench_peers.py")
bp = importlib.util.module_from_spec(_spec)
sys.modules["bench_peers"] = bp      # dataclasses look their module up by name
_spec.loader.exec_module(bp)
from protocol import PeerError, Worker  # noqa: E402  (bench_peers put tools/peers on sys.path)


# --- options ---------------------------------------------------------------------------------------------------

def test_defaults_are_the_issue_workloads_on_the_fast_path():
    args = bp.parse_args([])
    assert args.settings == bp.Settings(rounds=3, prompt_len=32, new_tokens=128, batch=16, prefill_len=512)
    # every llama.cpp format: Q4_1 (the same weights) and its fast paths on x86, made by its own quantizer; then
    # ik_llama.cpp on those fast formats and its own IQ4_KS
    assert args.engines == ["llama.cpp Q4_1", "llama.cpp Q4_0", "llama.cpp IQ4_NL", "llama.cpp Q8_0",
                            "ik_llama.cpp Q4_0", "ik_llama.cpp IQ4_NL", "ik_llama.cpp Q8_0", "ik_llama.cpp IQ4_KS",
                            "PyTorch", "tinyserve"]
    assert args.settings.threads == 2 and not args.threads_sweep
    # the CLI's default path (auto: the fastest accurate mode on the Numba kernels), not load_model's float32 reference
    assert bp.load_kwargs(args) == {"quant": "auto", "backend": "numba"}
    assert bp.engine_kwargs(args) == {"backend": "numba"}


def test_quick_is_one_short_round_and_explicit_options_win():
    q = bp.parse_args(["--quick"]).settings
    assert q.rounds == 1 and q.new_tokens < 128 and q.prefill_len < 512
    q2 = bp.parse_args(["--quick", "--rounds", "2", "--new-tokens", "5"]).settings
    assert (q2.rounds, q2.new_tokens, q2.prefill_len) == (2, 5, q.prefill_len)


def test_quant_and_backend_pass_through():
    args = bp.parse_args(["--quant", "w8a8", "--engines", "tinyserve"])
    assert bp.load_kwargs(args) == {"quant": "w8a8", "backend": "numba"}
    ref = bp.parse_args(["--quant", "none", "--backend", "numpy"])
    assert bp.load_kwargs(ref) == {"quant": "none", "backend": "numpy"} and bp.engine_kwargs(ref) == {"backend": "numpy"}
    assert args.engines == ["tinyserve"]


def test_llama_formats_and_threads_options():
    args = bp.parse_args(["--engines", "llama.cpp,tinyserve", "--llama-formats", "Q4_0,Q4_1", "--threads", "1"])
    assert args.engines == ["llama.cpp Q4_0", "llama.cpp Q4_1", "tinyserve"] and args.settings.threads == 1
    assert bp.sweep_threads(2) == [1, 2] and bp.sweep_threads(8) == [1, 2, 8] and bp.sweep_threads(1) == [1]
    ik = bp.parse_args(["--engines", "ik_llama.cpp,tinyserve", "--ik-formats", "IQ4_KS,Q8_0"])
    assert ik.engines == ["ik_llama.cpp IQ4_KS", "ik_llama.cpp Q8_0", "tinyserve"]
    assert ik.formats == [] and ik.ik_formats == ["IQ4_KS", "Q8_0"]     # llama.cpp not chosen: none of its formats


def test_formats_to_make_reuse_llama_cpps_files_for_ik_and_make_only_iq4_ks_with_iks_quantizer(tmp_path):
    made = {"Q4_0"}
    exists = lambda p: any(p.name.endswith(f".{f}.gguf") for f in made)   # noqa: E731
    args = bp.parse_args(["--gguf", str(tmp_path / "m.Q4_1.gguf")])
    assert bp.formats_to_make(args, exists) == (["IQ4_NL", "Q8_0"], ["IQ4_KS"])
    # ik alone still needs llama.cpp's quantizer for the formats the two share
    ik = bp.parse_args(["--gguf", str(tmp_path / "m.Q4_1.gguf"), "--engines", "ik_llama.cpp", "--ik-formats",
                        "Q8_0,IQ4_KS"])
    assert bp.formats_to_make(ik, exists) == (["Q8_0"], ["IQ4_KS"])
    only = bp.parse_args(["--gguf", str(tmp_path / "m.Q4_1.gguf"), "--engines", "llama.cpp", "--llama-formats",
                          "Q4_1,Q4_0"])
    assert bp.formats_to_make(only, exists) == ([], [])                   # Q4_1 ships, Q4_0 is made
    assert bp.gguf_path(args, "IQ4_KS") == tmp_path / "m.IQ4_KS.gguf"
    # ik repacks Q4_0 and Q8_0 at load (its default), not IQ4_NL nor IQ4_KS (NaN logits in 0.1.5)
    assert bp.ik_worker_args("Q4_0") == [] and bp.ik_worker_args("IQ4_KS") == ["--no-repack"]


def test_a_missing_ik_venv_skips_its_quantizer_with_a_message(tmp_path, capsys):
    q = tmp_path / "m.Q4_1.gguf"
    q.write_bytes(b"GGUF")
    (tmp_path / "m.Q4_0.gguf").write_bytes(b"GGUF")
    args = bp.parse_args(["--gguf", str(q), "--engines", "ik_llama.cpp", "--ik-formats", "Q4_0,IQ4_KS",
                          "--ik-python", str(tmp_path / "no-venv" / "python"), "--out", str(tmp_path / "p.json")])
    assert bp.prepare_formats(args) == 0
    assert "ik_llama.cpp's venv" in capsys.readouterr().err and not (tmp_path / "m.IQ4_KS.gguf").exists()


def test_model_runs_your_own_gguf_against_llama_cpp_on_the_peer_files(tmp_path):
    own = tmp_path / "llama-3.2-1b-Q4_K_M.gguf"
    args = bp.parse_args(["--model", str(own), "--quick"])
    assert args.engines == ["llama.cpp llama-3.2-1b-Q4_K_M", "tinyserve"]       # PyTorch reads the shipped folder only
    assert bp.gguf_path(args, "llama-3.2-1b-Q4_K_M") == own and bp.formats_to_make(args) == ([], [])
    race = bp.parse_args(["--model", str(own), "--peer-files", f"{tmp_path / 'a-Q4_0.gguf'},{own}",
                          "--engines", "llama.cpp,ik_llama.cpp,tinyserve"])
    assert race.engines == ["llama.cpp a-Q4_0", "llama.cpp llama-3.2-1b-Q4_K_M", "ik_llama.cpp a-Q4_0",
                            "ik_llama.cpp llama-3.2-1b-Q4_K_M", "tinyserve"]
    assert bp.gguf_path(race, "a-Q4_0") == tmp_path / "a-Q4_0.gguf"
    assert bp.main(["--model", str(tmp_path / "absent.gguf"), "--quick"]) == 2     # one line, before anything loads


@pytest.mark.parametrize("argv", [["--engines", "vllm"], ["--engines", ","], ["--rounds", "0"],
                                  ["--new-tokens", "1"], ["--batch", "0"], ["--threads", "0"],
                                  ["--llama-formats", "Q4_K"], ["--llama-formats", ","], ["--ik-formats", "Q4_1"],
                                  ["--ik-formats", ","], ["--peer-files", "a.gguf"],
                                  ["--model", "a.gguf", "--engines", "PyTorch,tinyserve"]])
def test_bad_options_are_refused_with_a_message(argv, capsys):
    with pytest.raises(SystemExit):
        bp.parse_args(argv)
    assert "error:" in capsys.readouterr().err


# --- the workloads' token ids, the agreement check, the CPU line ------------------------------------------------

def test_token_ids_same_for_every_engine_different_prompts_and_repeated_when_short():
    st = bp.Settings(batch=4, prompt_len=3, prefill_len=10)
    ids = bp.make_token_ids([5, 6, 7, 8, 9], st)
    assert ids["decode_b1"] == [[5, 6, 7]]
    assert ids["decode_bN"] == [[5, 6, 7], [8, 9, 5], [6, 7, 8], [9, 5, 6]]
    assert ids["prefill"] == [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9]]
    with pytest.raises(ValueError):
        bp.make_token_ids([], st)


def test_agreement_counts_leading_equal_tokens():
    assert bp.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert bp.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert bp.agreement([1, 2], [7, 2]) == 0


def test_cpu_info_reads_the_model_and_the_flags_of_note():
    text = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 avx512f avx512_vnni "
            "amx_tile amx_int8 sse4_2\n\nprocessor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n")
    info = bp.cpu_info(text)
    assert info == {"model": "Intel(R) Xeon(R) Processor", "flags": ["avx2", "avx512f", "avx512_vnni", "amx_tile",
                                                                     "amx_int8"]}
    assert bp.cpu_info("") == {"model": "unknown", "flags": []}


# --- medians, spreads, ratios, the table -------------------------------------------------------------------------

Q41, Q40 = "llama.cpp Q4_1", "llama.cpp Q4_0"


def _report() -> "bp.Report":
    rep = bp.Report(bp.Settings(rounds=3))
    for rnd, (tiny, llama, fast) in enumerate([(10.0, 20.0, 40.0), (20.0, 20.0, 10.0), (45.0, 30.0, 15.0)]):
        rep.samples += [bp.Sample(rnd, "tinyserve", "decode_b1", 100, 100 / tiny),
                        bp.Sample(rnd, Q41, "decode_b1", 100, 100 / llama),
                        bp.Sample(rnd, Q40, "decode_b1", 100, 100 / fast)]
    rep.samples += [bp.Sample(0, "tinyserve", "prefill", 512, 1.0), bp.Sample(0, "PyTorch", "prefill", 512, 0.5),
                    bp.Sample(0, Q40, "prefill", 512, 0.25)]
    return rep


def test_ratios_are_paired_round_by_round_then_the_median():
    rep = _report()
    s = rep.speeds("tinyserve", "decode_b1")
    assert (s.median, s.lo, s.hi, s.n) == pytest.approx((20.0, 10.0, 45.0, 3))
    r = rep.ratio("decode_b1", Q41)          # 10/20, 20/20, 45/30 -> median 1.0, not 20/20 by chance
    assert (r.median, r.lo, r.hi) == pytest.approx((1.0, 0.5, 1.5))
    assert rep.ratio("decode_bN", Q41) is None and rep.ratio("decode_bN", bp.BEST) is None
    assert rep.ratio("prefill", "PyTorch").median == pytest.approx(0.5)


def test_the_roofline_share_pairs_each_round_with_the_bandwidth_measured_in_it(tmp_path):
    rep = _report()
    assert rep.roofline_share() is None and bp.roofline_result(rep) is None      # no bandwidth measured
    rep.bytes_per_token = 10**9                            # tinyserve B=1: 10, 20, 45 tokens/s in rounds 0, 1, 2
    rep.bandwidth = {0: 20e9, 1: 80e9, 2: 50e9}
    share = rep.roofline_share()                           # 0.5, 0.25, 0.9: paired, not 20 / 50 = 0.4
    assert (share.median, share.lo, share.hi, share.n) == pytest.approx((0.5, 0.25, 0.9, 3))
    rf = bp.roofline_result(rep)
    assert rf["met"] is False and rf["goal"] == bp.ROOFLINE_GOAL and rf["bytes_per_token"] == 10**9
    assert bp._roofline_cell({"roofline": rf}) == "0.50 (0.25-0.90) of 50.0 GB/s, 1000 MB a token ✗"
    assert bp._roofline_cell({}) == "-"                    # a run recorded before the column
    assert "token_sized" not in rf                         # no token-sized read measured
    rep.token_sized_bandwidth = {0: 10e9, 1: 40e9, 2: 90e9}    # a read as large as a token's bytes, cache-helped
    ts = rep.roofline_share(token_sized=True)              # 1.0, 0.5, 0.5: paired with the same rounds
    assert (ts.median, ts.lo, ts.hi) == pytest.approx((0.5, 0.5, 1.0))
    rf = bp.roofline_result(rep)
    assert rf["met"] is False and rf["share"]["median"] == pytest.approx(0.5)    # the goal stays on 256 MiB
    assert bp._roofline_cell({"roofline": rf}) == ("0.50 (0.25-0.90) of 50.0 GB/s, 1000 MB a token ✗; "
                                                   "0.50 (0.50-1.00) of a token-sized read (40.0 GB/s)")


def test_the_best_llama_format_is_chosen_per_workload_by_its_median():
    rep = _report()
    # decode B=1: Q4_1 medians 20, Q4_0 15 (its one fast round does not make it the best): the best is Q4_1 there
    assert rep.best_llama("decode_b1") == Q41 and rep.best_llama("prefill") == Q40
    assert rep.best_llama("decode_bN") is None
    assert rep.ratio("decode_b1", bp.BEST) == rep.ratio("decode_b1", Q41)
    assert rep.ratio("prefill", bp.BEST).median == pytest.approx(0.25)    # 512 / 2048 tokens/s


def test_table_shows_medians_spreads_ratios_and_goals():
    rep = _report()
    rep.failed["PyTorch"] = "worker exited"
    table = bp.format_table(rep, [Q41, Q40, "PyTorch", "tinyserve"])
    lines = table.splitlines()
    assert len(lines) == 2 + 3 and set(lines[1]) <= {"-", " "}
    assert "tinyserve/best llama.cpp" in lines[0] and "tinyserve/llama.cpp Q4_1" in lines[0]
    b1 = next(line for line in lines if line.startswith("decode B=1"))
    assert "20.0 (10.0-45.0)" in b1 and "20.0 (20.0-30.0)" in b1      # tinyserve, llama.cpp Q4_1 tokens/s
    assert "1.00x (0.50-1.50) vs Q4_1 <" in b1                           # goal 1.15x the best peer: not met
    pre = next(line for line in lines if line.startswith("prefill 512"))
    assert "0.50x <" in pre and "512.0" in pre and "1024.0" in pre        # goal 1.2x PyTorch: not met
    assert "0.25x vs Q4_0 <" in pre                                        # goal 1.2x the best peer: not met
    assert "failed" in next(line for line in lines if line.startswith("decode B=16"))
    goals = bp.format_targets(rep, "avx512vnni")
    both = "best of llama.cpp and ik_llama.cpp"
    assert f"decode B=1: tinyserve >= 1.15x {both} (llama.cpp Q4_1)? 1.00x: not met" in goals
    assert "prefill 512: tinyserve >= 1.2x PyTorch? 0.50x: not met" in goals
    assert f"prefill 512: tinyserve >= 1.2x {both} (llama.cpp Q4_0)? 0.25x: not met" in goals
    assert f"B=16 (aggregate): tinyserve >= 1.5x {both}? not measured" in goals
    avx2 = bp.format_targets(rep, "avx2")                                  # AVX2-class kernels: lower goals
    assert "prefill 512: tinyserve >= 1.0x PyTorch?" in avx2 and "decode B=1: tinyserve >= 1.0x" in avx2
    assert "prefill 512: tinyserve >= 0.9x" in avx2 and "B=16 (aggregate): tinyserve >= 1.3x" in avx2
    met = {(g["workload"], g["peer"]): g["met"] for g in bp.goals_result(rep, "avx512vnni")}
    assert met == {("decode_b1", Q41): False, ("decode_bN", None): False, ("prefill", Q40): False,
                   ("prefill", "PyTorch"): False}


IK40, IKKS = "ik_llama.cpp Q4_0", "ik_llama.cpp IQ4_KS"


def _report_with_ik() -> "bp.Report":
    """_report plus ik_llama.cpp: faster than every llama.cpp format at B=1, slower in prefill."""
    rep = _report()
    for rnd, (fast, ks) in enumerate([(50.0, 30.0), (40.0, 35.0), (45.0, 5.0)]):
        rep.samples += [bp.Sample(rnd, IK40, "decode_b1", 100, 100 / fast),
                        bp.Sample(rnd, IKKS, "decode_b1", 100, 100 / ks)]
    rep.samples += [bp.Sample(0, IK40, "prefill", 512, 0.5), bp.Sample(0, IKKS, "prefill", 512, 1.0)]
    return rep


def test_the_goals_are_judged_against_the_faster_of_llama_cpp_and_ik_llama_cpp():
    rep = _report_with_ik()
    assert rep.best_llama("decode_b1") == Q41 and rep.resolve("decode_b1", bp.BEST_IK) == IK40
    assert rep.resolve("decode_b1", bp.BEST_BOTH) == IK40          # ik Q4_0's median 45 beats Q4_1's 20
    assert rep.resolve("prefill", bp.BEST_BOTH) == Q40             # llama.cpp Q4_0's 2048 beats ik's 1024
    assert rep.resolve("prefill", bp.BEST_IK) == IK40 and rep.resolve("decode_bN", bp.BEST_IK) is None
    r = rep.ratio("decode_b1", bp.BEST_BOTH)                       # 10/50, 20/40, 45/45
    assert (r.median, r.lo, r.hi) == pytest.approx((0.5, 0.2, 1.0))
    assert rep.ratio("decode_b1", bp.BEST_BOTH) == rep.ratio("decode_b1", IK40)
    met = {(g["workload"], g["peer"]): (g["goal"], g["met"]) for g in bp.goals_result(rep, "avx512vnni")}
    assert met[("decode_b1", IK40)] == (1.15, False) and met[("prefill", Q40)] == (1.2, False)
    assert "1.15x best of llama.cpp and ik_llama.cpp (ik_llama.cpp Q4_0)? 0.50x" in bp.format_targets(rep, "avx512vnni")
    lines = bp.format_table(rep, [Q41, Q40, IK40, IKKS, "tinyserve"]).splitlines()
    assert "tinyserve/best llama.cpp" in lines[0] and "tinyserve/best ik_llama.cpp" in lines[0]
    b1 = next(line for line in lines if line.startswith("decode B=1"))
    # the goal mark sits in the column of the fastest peer only: ik at B=1
    assert "1.00x (0.50-1.50) vs Q4_1  " in b1 + "  " and "0.50x (0.20-1.00) vs ik Q4_0 <" in b1
    pre = next(line for line in lines if line.startswith("prefill 512"))
    assert "0.25x vs Q4_0 <" in pre and "0.50x vs ik Q4_0" in pre and "0.50x vs ik Q4_0 <" not in pre
    assert bp.goal_for(rep, "prefill", bp.BEST_IK, "avx512vnni") is None
    assert bp.goal_for(rep, "prefill", bp.BEST, "avx2") == 0.9


def test_a_recorded_run_becomes_a_row_of_the_generated_table(tmp_path):
    rep = _report()
    result = {"time": "2026-12-04 23:10 UTC", "commit": "abc1234", "settings": dataclasses.asdict(rep.settings),
              "cpu": {"model": "AMD EPYC (family 25, model 17)", "kernels": "avx512vnni", "forced": False},
              "engines": {"tinyserve": {"quant": "w4a8"}},
              "summary": {k: {e: dataclasses.asdict(s) for e in ("tinyserve", Q41, Q40, "PyTorch")
                              if (s := rep.speeds(e, k))} for k in ("decode_b1", "decode_bN", "prefill")},
              "best_llama": {k: rep.best_llama(k) for k in ("decode_b1", "decode_bN", "prefill")},
              "ratios": {k: {p: dataclasses.asdict(r) for p in (Q41, Q40, "PyTorch", bp.BEST)
                             if (r := rep.ratio(k, p))} for k in ("decode_b1", "decode_bN", "prefill")},
              "goals": bp.goals_result(rep, "avx512vnni")}
    path = bp.record_run(result, tmp_path)
    assert path.name == "2026-12-04-2310-avx512vnni-t2.json"
    md = bp.write_table(tmp_path).read_text()
    row = next(line for line in md.splitlines() if line.startswith("| 2026-12-04 23:10"))
    assert "abc1234" in row and "AMD EPYC (family 25, model 17)" in row and "w4a8" in row
    assert "1.00x (0.50-1.50) vs Q4_1 ✗" in row and "0.25x vs Q4_0 ✗" in row
    assert "Do not edit by hand" in md


def _result(rep: "bp.Report", engines) -> dict:
    keys = ("decode_b1", "decode_bN", "prefill")
    return {"time": "2026-12-06 04:10 UTC", "commit": "def5678", "settings": dataclasses.asdict(rep.settings),
            "cpu": {"model": "AMD EPYC (family 25, model 17)", "kernels": "avx512vnni", "forced": False},
            "engines": {"tinyserve": {"quant": "w4a8"}},
            "summary": {k: {e: dataclasses.asdict(s) for e in engines if (s := rep.speeds(e, k))} for k in keys},
            "best_llama": {k: rep.best_llama(k) for k in keys},
            "best_ik": {k: rep.resolve(k, bp.BEST_IK) for k in keys},
            "ratios": {k: {p: dataclasses.asdict(r) for p in (*engines, bp.BEST, bp.BEST_IK, bp.BEST_BOTH)
                           if (r := rep.ratio(k, p))} for k in keys},
            "goals": bp.goals_result(rep, "avx512vnni"), "prefill_peak": bp.peak_result(rep)}


def test_a_run_with_ik_and_the_int8_peak_is_recorded_beside_an_older_run(tmp_path):
    rep = _report_with_ik()
    rep.macs_per_token, rep.peak_variant = 100_000_000, "avx512vnni"   # tinyserve prefill: 512 tokens/s, round 0
    rep.int8_peak = {0: 2.56e11}                                       # 512 x 1e8 / 2.56e11 = 0.2
    bp.record_run(_result(rep, ("tinyserve", Q41, Q40, IK40, IKKS, "PyTorch")), tmp_path)
    old = _report()
    bp.record_run({**_result(old, ("tinyserve", Q41, Q40, "PyTorch")), "time": "2026-12-04 23:10 UTC",
                   "best_ik": None, "prefill_peak": None}, tmp_path)
    md = bp.write_table(tmp_path).read_text()
    head = next(line for line in md.splitlines() if line.startswith("| date"))
    assert "decode B=1 / best ik_llama.cpp" in head and "prefill 512 / int8 peak" in head
    assert "ik_llama.cpp IQ4_KS" in md.split("## Tokens/s")[1]
    new = next(line for line in md.splitlines() if line.startswith("| 2026-12-06 04:10"))
    cells = [c.strip() for c in new.split("|")[1:-1]]
    assert cells[6:8] == ["1.00x (0.50-1.50) vs Q4_1", "0.50x (0.20-1.00) vs ik Q4_0 ✗"]    # B=1: ik is the best
    assert cells[10:12] == ["0.25x vs Q4_0 ✗", "0.50x vs ik Q4_0"]                          # prefill: llama.cpp
    assert cells[-1] == "0.20 of 256 G multiply-adds/s (avx512vnni), 100 M a token ✗"
    older = next(line for line in md.splitlines() if line.startswith("| 2026-12-04 23:10"))
    cells = [c.strip() for c in older.split("|")[1:-1]]
    assert cells[6:8] == ["1.00x (0.50-1.50) vs Q4_1 ✗", "-"] and cells[-1] == "-"


def test_the_peak_share_pairs_each_round_with_the_peak_measured_in_it():
    rep = _report()
    rep.samples += [bp.Sample(1, "tinyserve", "prefill", 512, 0.5), bp.Sample(2, "tinyserve", "prefill", 512, 2.0)]
    assert rep.peak_share() is None and bp.peak_result(rep) is None        # no peak measured
    rep.macs_per_token = 10**8                              # 512, 1024, 256 tokens/s: 51.2, 102.4, 25.6 G/s
    rep.int8_peak = {0: 102.4e9, 1: 204.8e9, 2: 25.6e9}
    share = rep.peak_share()                                # 0.5, 0.5, 1.0: paired round by round
    assert (share.median, share.lo, share.hi, share.n) == pytest.approx((0.5, 0.5, 1.0, 3))
    pk = bp.peak_result(rep)
    assert pk["met"] is True and pk["goal"] == bp.PEAK_GOAL == 0.5 and pk["peak"]["1"] == 204.8e9


def test_rounds_measure_the_int8_peak_once_a_round_and_go_on_without_it(capsys, monkeypatch):
    monkeypatch.setattr(bp, "COOLDOWN_S", 0.0)
    monkeypatch.setattr(bp, "round_bandwidth", lambda threads, nbytes=0: 1e10)
    asked = []

    def peak(variant, threads):
        asked.append((variant, threads))
        if len(asked) == 2:
            raise bp.PeakError("int8 peak: no C compiler")
        return 3e11
    monkeypatch.setattr(bp, "round_int8_peak", peak)
    st, rep = _settings_and_report(rounds=3)
    rep.macs_per_token, rep.peak_variant = 10**8, "avx2"
    bp.run_rounds({"tinyserve": FakeEngine(75.0)}, rep)
    assert asked == [("avx2", 2), ("avx2", 2)]              # after a failure, not asked again
    assert rep.int8_peak == {0: 3e11} and rep.peak_error == "int8 peak: no C compiler"
    assert rep.peak_share().median == pytest.approx(75.0 * 1e8 / 3e11)
    out = capsys.readouterr()
    assert "int8 peak (avx2, 2 thread(s)) 300 G multiply-adds/s" in out.out and "left out" in out.err


def test_pytorch_is_held_to_avx2_only_beside_forced_avx2_class_kernels():
    env = {"PATH": "/bin"}
    assert bp.torch_env(env, "avx512vnni", forced=False) is env
    assert bp.torch_env(env, "avx2", forced=False) is env            # an AVX2 CPU's own: PyTorch is held by the CPU
    held = bp.torch_env(env, "avx2", forced=True)
    assert held["ATEN_CPU_CAPABILITY"] == "avx2" and held["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert held["PATH"] == "/bin"
    assert bp.torch_env({"ONEDNN_MAX_CPU_ISA": "SSE41"}, "avxvnni", forced=True)["ONEDNN_MAX_CPU_ISA"] == "SSE41"


def test_table_without_tinyserve_has_no_ratio_columns():
    table = bp.format_table(_report(), [Q41])
    assert "x" not in table.replace("max", "") and "tinyserve" not in table


# --- the worker protocol, against fake workers -------------------------------------------------------------------

FAKE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {peers!r})
    from protocol import serve

    def load():
        if os.environ.get("FAKE_FAIL_LOAD"):
            raise RuntimeError("no such model file")
        print("a native library chatting on stdout")          # must not reach the protocol channel
        os.write(1, b"and one writing to fd 1 directly\\n")

        def decode(prompts, new_tokens):
            print("noise during a request")
            return {{"tokens": [[p[-1]] * new_tokens for p in prompts], "decode_seconds": 0.5,
                    "decode_tokens": len(prompts) * (new_tokens - 1)}}

        def boom():
            raise ValueError("the batch does not fit")

        def die():
            sys.stderr.write("fatal: segmentation fault in llama_decode\\n"); sys.stderr.flush()
            os._exit(3)

        return {{"engine": "fake"}}, {{"decode": decode, "boom": boom, "die": die}}

    raise SystemExit(serve(load))
""")


@pytest.fixture
def fake_worker(tmp_path):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE.format(peers=str(ROOT / "tools" / "peers")))

    def start(**env):
        import os
        return Worker("fake", [sys.executable, str(script)], tmp_path / "fake.log", env={**os.environ, **env})
    return start


def test_worker_round_trip_survives_stray_stdout(fake_worker, tmp_path):
    w = fake_worker()
    try:
        assert w.info == {"engine": "fake"}
        r = w.request("decode", prompts=[[1, 2, 3], [4, 5]], new_tokens=4)
        assert r == {"ok": True, "tokens": [[3, 3, 3, 3], [5, 5, 5, 5]], "decode_seconds": 0.5, "decode_tokens": 6}
        s = bp.measure(w, "decode_bN", [[1, 2, 3], [4, 5]], bp.Settings(new_tokens=4), 0, "fake")
        assert (s.tokens, s.seconds, s.tokens_per_s) == (6, 0.5, 12.0)
        with pytest.raises(PeerError, match="unknown command 'prefill'"):
            w.request("prefill", ids=[1])
        with pytest.raises(PeerError, match="boom: ValueError: the batch does not fit"):
            w.request("boom")
        assert w.request("decode", prompts=[[9]], new_tokens=2)["tokens"] == [[9, 9]]   # still serving
    finally:
        w.close()
    assert w.proc.returncode == 0
    log = (tmp_path / "fake.log").read_text()
    assert "a native library chatting on stdout" in log and "noise during a request" in log


def test_a_worker_that_dies_is_reported_with_its_exit_code_and_log(fake_worker):
    w = fake_worker()
    with pytest.raises(PeerError, match=r"exited with code 3(.|\n)*segmentation fault in llama_decode"):
        w.request("die")
    with pytest.raises(PeerError, match="exited with code 3"):
        w.request("decode", prompts=[[1]], new_tokens=2)
    w.close()


def test_a_worker_that_cannot_load_says_why(fake_worker):
    with pytest.raises(PeerError, match="could not start: RuntimeError: no such model file"):
        fake_worker(FAKE_FAIL_LOAD="1")


# --- tinyserve's side --------------------------------------------------------------------------------------------

def test_tinyserve_decode_times_decode_steps_only_and_ignores_eos(tiny):
    prompts = [[3, 7, 11, 5], [9, 4, 2, 8], [6, 6, 1, 12]]
    r = bp.tinyserve_decode(tiny, prompts, new_tokens=6)
    assert r["decode_tokens"] == 3 * 5 and r["decode_seconds"] > 0
    assert all(len(t) == 6 for t in r["tokens"])        # EOS (id 2) ignored: all 6 tokens every time
    greedy = ts.SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    assert r["tokens"] == [ts.kv_cache.generate(tiny, p, 6, greedy) for p in prompts]


def test_tinyserve_prefill_predicts_the_next_greedy_token(tiny):
    ids = [3, 7, 11, 5, 9, 4]
    r = bp.tinyserve_prefill(tiny, ids)
    assert r["seconds"] > 0
    assert r["next_token"] == int(np.argmax(ts.naive.forward(tiny, ids)[-1]))


@pytest.mark.real
@pytest.mark.slow
def test_quick_run_with_tinyserve_alone_writes_the_json(tmp_path, capsys):
    out = tmp_path / "peers.json"
    assert bp.main(["--quick", "--engines", "tinyserve", "--batch", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "CPU:" in printed and "decode B=4 (aggregate)" in printed
    data = json.loads(out.read_text())
    assert {s["workload"] for s in data["samples"]} == {"decode_b1", "decode_bN", "prefill"}
    assert all(s["engine"] == "tinyserve" and s["tokens_per_s"] > 0 for s in data["samples"])
    assert data["settings"]["rounds"] == 1 and data["ratios"] == {"decode_b1": {}, "decode_bN": {}, "prefill": {}}
    rf = data["roofline"]                                  # B=1 against the bandwidth measured in the round
    assert rf["bytes_per_token"] > 0 and 0 < rf["share"]["median"] and rf["bandwidth"]["0"] > 1e8
    assert "of the read bandwidth measured in the same rounds" in printed
    assert rf["token_sized"]["bandwidth"]["0"] > 1e8 and "of a read as large as a token's bytes" in printed
    pk = data["prefill_peak"]                              # the prefill against the int8 peak of the round
    if peak.compiler() is not None:
        from tinyserve.weights import DEFAULT_WEIGHTS_DIR
        assert pk["macs_per_token"] == peak.model_macs_per_token(ts.config.ModelConfig.load(DEFAULT_WEIGHTS_DIR))
        assert 0 < pk["share"]["median"] < 1 and pk["peak"]["0"] > 1e9 and "of the int8 peak" in printed


# --- the run itself, with in-process fake engines -----------------------------------------------------------------

class FakeEngine:
    """Answers like a worker: tokens continue the last prompt token; speed `rate` tokens/s; can fail on call n."""

    def __init__(self, rate: float, fail_on_call: int | None = None, shift: int = 0):
        self.rate, self.fail_on_call, self.shift, self.calls, self.closed = rate, fail_on_call, shift, [], False
        self.info = {"engine": "fake"}

    def request(self, cmd: str, **f) -> dict:
        self.calls.append(cmd)
        if len(self.calls) == self.fail_on_call:
            raise PeerError("worker exited with code -11")
        if cmd == "prefill":
            return {"seconds": len(f["ids"]) / self.rate, "next_token": 0}
        n = len(f["prompts"]) * (f["new_tokens"] - 1)
        toks = [[p[-1] + i + (self.shift if i >= 2 else 0) for i in range(f["new_tokens"])] for p in f["prompts"]]
        return {"tokens": toks, "decode_seconds": n / self.rate, "decode_tokens": n}

    def close(self) -> None:
        self.closed = True


def _settings_and_report(rounds=2):
    st = bp.Settings(rounds=rounds, new_tokens=5, batch=3, prompt_len=4, prefill_len=8, check_tokens=4)
    return st, bp.Report(st, prompts=bp.make_token_ids(list(range(10, 40)), st))


def test_rounds_measure_every_engine_on_every_workload_and_drop_a_failing_one(capsys, monkeypatch):
    monkeypatch.setattr(bp, "COOLDOWN_S", 0.0)                 # the fake engines leave no threads spinning
    monkeypatch.setattr(bp, "round_bandwidth", lambda threads, nbytes=256 * 2**20: 1e10 * (1 + threads) + nbytes)
    st, rep = _settings_and_report(rounds=3)
    engines = {Q41: FakeEngine(100.0, fail_on_call=4), "PyTorch": FakeEngine(50.0),
               "tinyserve": FakeEngine(75.0)}
    crashed = engines[Q41]
    bp.run_rounds(engines, rep)
    assert crashed.closed and Q41 not in engines and "code -11" in rep.failed[Q41]
    assert len([s for s in rep.samples if s.engine == Q41]) == 3      # round 1 only, then dropped
    for name in ("PyTorch", "tinyserve"):
        assert sorted((s.round, s.workload) for s in rep.samples if s.engine == name) == sorted(
            (r, w) for r in range(3) for w in ("decode_b1", "decode_bN", "prefill"))
    assert rep.speeds("PyTorch", "decode_bN").median == pytest.approx(50.0)
    assert rep.ratio("prefill", "PyTorch").median == pytest.approx(1.5)
    assert rep.ratio("decode_b1", Q41).n == 1
    assert rep.bandwidth == {0: 3e10 + 2**28, 1: 3e10 + 2**28, 2: 3e10 + 2**28}    # once a round, at 2 threads
    assert rep.token_sized_bandwidth == {}                # bytes_per_token unknown: no token-sized read
    assert "dropped from the rest of the run" in capsys.readouterr().err


def test_rounds_also_read_a_matrix_as_large_as_a_token_reads(capsys, monkeypatch):
    monkeypatch.setattr(bp, "COOLDOWN_S", 0.0)
    sizes = []

    def bandwidth(threads, nbytes=256 * 2**20):             # 1, 2, 3, 4 GB/s in the order asked
        sizes.append(nbytes)
        return 1e9 * len(sizes)
    monkeypatch.setattr(bp, "round_bandwidth", bandwidth)
    st, rep = _settings_and_report(rounds=2)
    rep.bytes_per_token = 99_000_000
    bp.run_rounds({"tinyserve": FakeEngine(75.0)}, rep)
    assert sizes == [2**28, 99_000_000] * 2                # each round: 256 MiB, then a token's bytes
    assert rep.bandwidth == {0: 1e9, 1: 3e9} and rep.token_sized_bandwidth == {0: 2e9, 1: 4e9}
    assert "4.0 GB/s over 99 MB, a token's bytes" in capsys.readouterr().out


def test_greedy_check_compares_peers_with_tinyserve_and_warms_up_every_workload(capsys):
    st, rep = _settings_and_report()
    engines = {Q41: FakeEngine(1.0, shift=7), "PyTorch": FakeEngine(1.0), "tinyserve": FakeEngine(1.0)}
    agree = bp.greedy_check(engines, rep, [1, 2, 3], decode=lambda ids: " ".join(map(str, ids)))
    assert agree["PyTorch"]["equal_leading_tokens"] == 4 and agree[Q41]["equal_leading_tokens"] == 2
    assert all(e.calls == ["decode", "decode", "decode", "prefill"] for e in engines.values())
    printed = capsys.readouterr().out
    assert "PyTorch: 4/4 tokens equal to tinyserve's: identical" in printed
    assert "after the 8-token prefill prompt: llama.cpp Q4_1 0, PyTorch 0, tinyserve 0" in printed
    assert agree[Q41]["after_prefill_equal"] is True
    assert "llama.cpp Q4_1: 2/4 tokens equal" in printed and "expected, not an error" in printed


# --- the int8 peak microbenchmark (tools/int8_peak.py) ------------------------------------------------------------

peak = sys.modules["int8_peak"]          # bench_peers imported it from tools/


def test_macs_per_token_count_the_layers_matrices_by_hand():
    cfg = ts.config.ModelConfig(dim=8, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=12, vocab_size=50)
    # per layer: Q 8x8, K and V 8x4 each, O 8x8, gate/up/down 8x12 each = 64 + 64 + 64 + 288 = 480
    assert peak.model_macs_per_token(cfg) == 2 * 480
    smol = ts.config.ModelConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536,
                                 vocab_size=49152)
    assert peak.model_macs_per_token(smol) == 106_168_320      # the issue's "about 106 M multiply-adds a token"


def test_the_programs_line_is_parsed_or_refused_with_a_message():
    p = peak.parse('{"variant": "avx2", "threads": 2, "macs_per_s": 1.5e+11, "macs_per_instruction": 32, '
                   '"seconds": 0.1, "sink": 7}')
    assert p == peak.Peak("avx2", 2, 1.5e11, 32)
    with pytest.raises(peak.PeakError, match="not its JSON line"):
        peak.parse("Segmentation fault")
    with pytest.raises(peak.PeakError, match="no int8 dot-product instruction for the 'generic' kernels"):
        peak.measure("generic", 2)


@pytest.mark.skipif(peak.compiler() is None or not sys.platform.startswith("linux"),
                    reason="needs a C compiler with OpenMP (tools/int8_peak.c)")
def test_the_peak_program_compiles_runs_and_counts_what_it_ran():
    from tinyserve.kernels import isa
    if isa.NAME not in peak.VARIANTS:
        pytest.skip(f"the {isa.NAME} kernels have no int8 dot-product instruction to measure")
    one = peak.measure(isa.NAME, 1, steps=2000, repeat=2)
    assert one.variant == isa.NAME and one.threads == 1
    assert one.macs_per_instruction == {"avx512vnni": 64, "avxvnni": 32, "avx2": 32, "neon": 16}[isa.NAME]
    assert 1e9 < one.macs_per_s < 1e13             # between a slow emulator and far beyond any CPU core
    with pytest.raises(peak.PeakError):
        peak.measure(isa.NAME, 0)                  # the program refuses 0 threads with its own message


# --- the ik_llama.cpp worker's settings (tools/peers/ik_worker.py; its venv is not needed to read them) -----------

def test_ik_worker_turns_flash_attention_off_for_several_sequences_and_keeps_v_in_f16_there():
    import ik_worker
    args, st = ik_worker.parse_args(["--gguf", "m.gguf"])
    assert st == ik_worker.IkSettings(repack=True, flash_attn="auto", kv="q8_0", merge_qkv=False)
    assert st.uses_flash_attn(1) and st.cache_types(1) == ("q8_0", "q8_0")
    assert not st.uses_flash_attn(16) and st.cache_types(16) == ("q8_0", "f16")   # ik: quantized V needs FA
    _, on = ik_worker.parse_args(["--gguf", "m.gguf", "--flash-attn", "on", "--no-repack", "--kv", "f16"])
    assert on.uses_flash_attn(16) and on.cache_types(16) == ("f16", "f16") and not on.repack
    _, off = ik_worker.parse_args(["--gguf", "m.gguf", "--flash-attn", "off"])
    assert not off.uses_flash_attn(1) and off.cache_types(1) == ("q8_0", "f16")
