"""Lesson 6 in the Engine: every decoding request may carry a draft, verified in the same batched forward as
everyone else's rows. Greedy output must equal plain decoding for every drafter and k, with the prefix trie on and
under forced preemption; no block may leak, and no block holding an unverified token may reach the trie."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import tinyserve as ts
from tinyserve import kv_cache
from tinyserve import speculative as sp
from tinyserve.drafters import ModelDrafter, make_drafter
from tinyserve.engine import Engine
from tinyserve.prefix_cache import cached_prefixes
from tinyserve.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
KS = (1, 2, 4, 8)


def prompts(seed=0, n=8):
    rng = np.random.default_rng(seed)
    out = [[int(t) for t in rng.integers(3, 256, int(m))] for m in rng.integers(1, 40, n)]
    return out + [out[1] * 3, out[2] * 2]       # repeated text: the n-gram drafter finds matches


def drafter_factories(model):
    seven = ts.tiny_model(seed=7)
    return {"ngram": "ngram",
            "early-exit": lambda: make_drafter("early-exit", model, early_exit_layers=1),
            "draft": lambda: make_drafter("draft", model, draft_model=seven)}


@pytest.fixture(scope="module")
def reference(tiny):
    ps = prompts()
    return ps, [kv_cache.generate(tiny, p, params=GREEDY) for p in ps]


def assert_no_leaks(engine):
    alloc = engine.blocks.allocator
    alloc.check()
    if engine.blocks.cache is not None:
        engine.blocks.cache.check()
        engine.blocks.cache.clear()
    assert alloc.num_free == alloc.num_blocks, f"{alloc.num_used} blocks leaked"
    assert not engine.running and not engine.waiting


# (num_blocks, block_size, max_batch_tokens)
CONFIGS = {"roomy": (256, 4, 256), "tiny-pool-preempts": (26, 4, 64), "budget-cuts-drafts": (64, 4, 6)}


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("kind", ["ngram", "early-exit", "draft"])
def test_engine_greedy_speculative_equals_plain(tiny, reference, kind, k):
    ps, expected = reference
    for name, (num_blocks, bs, budget) in CONFIGS.items():
        engine = Engine(tiny, num_blocks=num_blocks, block_size=bs, max_batch_tokens=budget,
                        speculative=drafter_factories(tiny)[kind], draft_k=k)
        assert engine.generate(ps, GREEDY) == expected, f"{kind}, k={k}, {name}"
        assert engine.speculator.stats.steps > 0 and all(s.num_tokens <= budget for s in engine.stats)
        if name == "tiny-pool-preempts":
            assert sum(s.num_preempted for s in engine.stats) > 0, "this pool is meant to force preemption"
        assert_no_leaks(engine)


def shared_prompts(seed=1, vocab=256):
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(3, vocab, 21)]
    tails = [[int(t) for t in rng.integers(3, vocab, rng.integers(1, 9))] for _ in range(6)]
    return [system + t for t in tails] + [system + system[:10]]


@pytest.mark.parametrize("kind", ["ngram", "early-exit", "draft"])
@pytest.mark.parametrize("num_blocks", [200, 24])
def test_prefix_caching_only_ever_publishes_verified_blocks(tiny, kind, num_blocks):
    ps = shared_prompts()
    plain = Engine(tiny, num_blocks=num_blocks, block_size=4, max_batch_tokens=32).generate(ps, GREEDY)
    engine = Engine(tiny, num_blocks=num_blocks, block_size=4, max_batch_tokens=32, prefix_caching=True,
                    speculative=drafter_factories(tiny)[kind], draft_k=4)
    verified: list[list[int]] = []

    def check_trie(_outputs):
        # after every step: each cached block's token prefix is a prefix of some request's verified tokens
        seqs = [*engine.running, *engine.waiting, *engine.finished.values()]
        texts = [tuple(s.prompt_ids + s.output_ids) for s in seqs] + [tuple(v) for v in verified]
        for prefix in cached_prefixes(engine.blocks.cache.root, 4):
            assert any(t[:len(prefix)] == prefix for t in texts), f"the trie holds an unverified prefix {prefix}"

    for round_ in range(2):                                   # the second round starts from a warm trie
        ids = [engine.add_request(p, GREEDY) for p in ps]
        engine.run(progress=check_trie)
        out = [engine.finished[i].output_ids for i in ids]
        assert out == plain, f"round {round_}"
        verified += [p + o for p, o in zip(ps, out)]
    if num_blocks == 24:
        assert sum(s.num_preempted for s in engine.stats) > 0
    assert engine.speculator.stats.accepted > 0
    assert_no_leaks(engine)


def test_adaptive_k_in_the_engine_is_identical(tiny, reference):
    ps, expected = reference
    engine = Engine(tiny, num_blocks=64, block_size=4, speculative="ngram", draft_k=8, adaptive_k=True)
    assert engine.generate(ps, GREEDY) == expected
    ks = [k for i in range(len(ps)) for k in engine.finished[i].spec.stats.ks]
    assert ks and max(ks) <= 8
    assert_no_leaks(engine)


def test_verification_rows_share_the_forward_with_plain_decodes_and_prefills(tiny, reference, monkeypatch):
    # one forward per step, and its logit rows = 1 per plain sample + (k + 1) per verifying request
    ps, expected = reference
    calls = []
    real_forward = __import__("tinyserve.engine", fromlist=["forward"]).forward

    def counting_forward(model, tokens, positions, attention, logit_rows=None, kv_layout=None):
        calls.append((len(tokens), len(tokens) if logit_rows is None else len(logit_rows)))   # None: every row
        return real_forward(model, tokens, positions, attention, logit_rows, kv_layout)
    monkeypatch.setattr("tinyserve.engine.forward", counting_forward)
    engine = Engine(tiny, num_blocks=128, block_size=4, max_batch_tokens=64, speculative="ngram", draft_k=4)
    assert engine.generate(ps, GREEDY) == expected
    assert len(calls) == len(engine.stats)
    mixed = [s for s in engine.stats if s.num_drafted and s.num_decode]
    assert mixed, "some step should verify drafts next to plain decodes"
    for (rows, logit_rows), s in zip(calls, engine.stats):
        assert rows == s.num_tokens
        assert logit_rows == s.num_sampled + s.num_drafted


def test_engine_stops_inside_an_accepted_run(tiny):
    ids = prompts()[3]
    plain = kv_cache.generate(tiny, ids, 20, SamplingParams(temperature=0))
    model = replace(tiny, config=replace(tiny.config, eos_token_ids=(plain[5],)))
    expected = kv_cache.generate(model, ids, 20, SamplingParams(temperature=0))
    engine = Engine(model, num_blocks=64, block_size=4, draft_k=8,
                    speculative=lambda: ModelDrafter(model, target=model))   # the target drafts: all accepted
    out = engine.generate([ids], SamplingParams(temperature=0, max_new_tokens=20))
    assert out == [expected] and out[0][-1] == plain[5]
    assert engine.finished[0].finish_reason == "eos"
    for max_new in (1, 3, 9):
        got = engine.generate([ids], SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True))
        assert got == [kv_cache.generate(model, ids, max_new, SamplingParams(temperature=0, ignore_eos=True))]
    assert_no_leaks(engine)


def test_seeded_sampling_with_drafts_does_not_depend_on_the_batch(tiny):
    ps = prompts(seed=3)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=10, seed=5)
    alone = [Engine(tiny, num_blocks=64, block_size=4, speculative="early-exit").generate([p], params)[0]
             for p in ps[:3]]
    together = Engine(tiny, num_blocks=64, block_size=4, speculative="early-exit").generate(ps[:3], params)
    assert together == alone


def test_metrics_report_acceptance(tiny, reference):
    ps, _ = reference
    engine = Engine(tiny, num_blocks=128, block_size=4, speculative=lambda: ModelDrafter(tiny, target=tiny),
                    draft_k=3)
    engine.generate(ps[:2], GREEDY)
    m = engine.finished[0].metrics()
    assert m.draft_alpha == 1.0 and m.tokens_per_step > 1
    total = engine.speculator.stats
    assert total.accepted == sum(engine.finished[i].spec.stats.accepted for i in range(2))
    assert total.accepted == sum(s.num_accepted for s in engine.stats)
    assert total.drafted == sum(s.num_drafted for s in engine.stats)
    plain = Engine(tiny, num_blocks=128, block_size=4)
    plain.generate(ps[:1], GREEDY)
    assert plain.finished[0].metrics().draft_alpha is None


def test_engine_refuses_bad_speculative_arguments(tiny):
    with pytest.raises(ValueError, match="unknown drafter"):
        Engine(tiny, speculative="crystal-ball")
    with pytest.raises(ValueError, match="draft model"):
        Engine(tiny, speculative="int8")
    with pytest.raises(ValueError, match="draft_k"):
        Engine(tiny, speculative="ngram", draft_k=0)


def test_a_failing_drafter_ends_only_its_request(tiny, reference):
    ps, expected = reference

    class Broken:
        name, cost = "broken", 0.0

        def propose(self, context, k, params, rng):
            raise RuntimeError("drafter exploded")
    made = []

    def factory():
        made.append(Broken() if not made else sp.NgramDrafter())   # the first request's drafter is broken
        return made[-1]
    engine = Engine(tiny, num_blocks=128, block_size=4, speculative=factory)
    ids = [engine.add_request(p, GREEDY) for p in ps[:3]]
    engine.run()
    assert engine.finished[ids[0]].finish_reason == "error" and "exploded" in engine.finished[ids[0]].error
    assert [engine.finished[i].output_ids for i in ids[1:]] == expected[1:3]
    assert_no_leaks(engine)


@pytest.mark.real
@pytest.mark.slow
def test_smollm2_engine_speculative_matches_plain(smol, smol_tok):
    doc = "Paris is the capital of France. It is known for the Eiffel Tower and the Louvre museum."
    ps = [smol_tok.encode_chat([{"role": "user", "content": doc + "\nRepeat the text above."}]),
          smol_tok.encode_chat([{"role": "user", "content": "Write a haiku about rain."}])]
    params = SamplingParams(temperature=0, max_new_tokens=10)
    expected = [kv_cache.generate(smol, p, params=params) for p in ps]
    engine = Engine(smol, num_blocks=64, block_size=16, max_batch_tokens=512, speculative="ngram", draft_k=4)
    assert engine.generate(ps, params) == expected
    assert engine.speculator.stats.accepted > 0
    assert_no_leaks(engine)


# --- the command line ------------------------------------------------------------------------------------------

def test_bench_cli_takes_the_speculative_options(capsys):
    from tinyserve.__main__ import main
    assert main(["bench", "--model", "tiny", "--requests", "3", "--prompt-len", "4:20", "--output-len", "6",
                 "--sweep", "", "--num-blocks", "32", "--block-size", "4", "--speculative", "ngram",
                 "--draft-k", "3", "--adaptive-k"]) == 0
    out = capsys.readouterr().out
    assert "'speculative': 'ngram'" in out and "'draft_k': 3" in out and "out tok/s" in out


@pytest.mark.real
def test_generate_cli_summary_says_what_speculation_did_never_nan(smol, capsys):
    from tinyserve.__main__ import main
    for n, words in ((1, "no verify step ran"), (12, "tokens per forward")):
        assert main(["generate", "--quant", "none", "--backend", "numpy", "--temperature", "0", "--max-new-tokens",
                     str(n), "--speculative", "ngram", "one two three, one two three, one two"]) == 0
        err = capsys.readouterr().err
        assert words in err and "nan" not in err, err


def test_cli_refuses_an_unknown_drafter():
    from tinyserve.__main__ import main
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--speculative", "oracle"])


@pytest.mark.real
@pytest.mark.slow
def test_generate_and_chat_cli_speculative_match_plain(smol, monkeypatch, capsys):
    import io
    import json
    from tinyserve.__main__ import main
    runs = {}
    for flags in ([], ["--speculative", "ngram", "--draft-k", "6"], ["--strategy", "paged", "--speculative", "ngram"]):
        assert main(["generate", "--chat", "Repeat: one two three, one two three.", "--max-new-tokens", "8",
                     "--json", *flags]) == 0
        runs[tuple(flags)] = json.loads(capsys.readouterr().out)
    outs = [r["output_ids"] for r in runs.values()]
    assert outs[0] == outs[1] == outs[2]
    assert "draft_alpha" in runs[("--speculative", "ngram", "--draft-k", "6")]
    monkeypatch.setattr("sys.stdin", io.StringIO("Say hi.\n"))
    assert main(["chat", "--max-new-tokens", "4", "--num-blocks", "32", "--speculative", "ngram"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "[turn 1:" in err
