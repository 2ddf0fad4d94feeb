"""The continuous-batching engine against the single-sequence KV-cache path (lesson 2), which it must match token
for token: whatever the pool size (forced preemption), the prefill budget (chunking), the block size, and
whatever else shares the batch. After every run, every block is back in the pool.
"""
from __future__ import annotations

import numpy as np
import pytest

import tinyserve as ts
from tinyserve import kv_cache
from tinyserve import engine as engine_mod
from tinyserve.engine import Engine, StepOutput, generate_stream
from tinyserve.kv_sizing import max_kv_positions
from tinyserve.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


def mixed_prompts(n: int = 16, vocab: int = 256, seed: int = 0, lo: int = 1, hi: int = 70) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, size=int(m))] for m in rng.integers(lo, hi, size=n)]


def assert_no_leaks(engine: Engine) -> None:
    alloc = engine.blocks.allocator
    alloc.check()
    assert alloc.num_free == alloc.num_blocks, f"{alloc.num_used} blocks leaked"
    assert not engine.running and not engine.waiting


@pytest.fixture(scope="module")
def tiny_reference(tiny):
    prompts = mixed_prompts()
    return prompts, [kv_cache.generate(tiny, p, params=GREEDY) for p in prompts]


# (num_blocks, block_size, max_batch_tokens): roomy; tiny pools (preemption); budgets from 1 token to everything
CONFIGS = {
    "roomy": (256, 16, 1024),
    "chunked-7": (256, 16, 7),
    "one-token-per-step": (64, 8, 1),
    "tiny-pool-preempts": (20, 4, 64),
    "tiny-pool-chunked": (20, 4, 5),
    "block-size-1": (80, 1, 33),
}


@pytest.mark.parametrize("num_blocks, block_size, budget", CONFIGS.values(), ids=CONFIGS.keys())
def test_engine_matches_kv_cache_generate(tiny, tiny_reference, num_blocks, block_size, budget):
    prompts, expected = tiny_reference
    engine = Engine(tiny, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=budget)
    assert engine.generate(prompts, GREEDY) == expected
    assert_no_leaks(engine)
    assert all(s.num_tokens <= budget for s in engine.stats)
    assert engine.peak_blocks_used <= num_blocks
    if num_blocks == 20:
        assert sum(s.num_preempted for s in engine.stats) > 0, "this pool is meant to force preemption"


def test_batched_steps_mix_decodes_and_prefill_chunks(tiny, tiny_reference):
    prompts, expected = tiny_reference
    engine = Engine(tiny, num_blocks=256, block_size=16, max_batch_tokens=24)
    assert engine.generate(prompts, GREEDY) == expected
    # some step ran decodes of earlier requests next to a prefill chunk of a later one
    assert any(s.num_decode > 0 and s.num_tokens > s.num_seqs for s in engine.stats)
    assert max(s.num_seqs for s in engine.stats) >= 8


def test_one_forward_per_step_with_logits_only_for_sampled_rows(tiny, monkeypatch):
    calls = []
    real = engine_mod.forward

    def spy(model, tokens, positions, attention, logit_rows=None, kv_layout=None):
        calls.append((len(tokens), len(tokens) if logit_rows is None else len(logit_rows)))   # None: every row
        return real(model, tokens, positions, attention, logit_rows=logit_rows, kv_layout=kv_layout)

    monkeypatch.setattr(engine_mod, "forward", spy)
    engine = Engine(tiny, num_blocks=64, block_size=4, max_batch_tokens=8)
    for p in ([5] * 20, [6] * 3, [7] * 2):
        engine.add_request(p, GREEDY)
    for _ in range(6):
        calls.clear()
        outs = engine.step()
        assert len(calls) == 1, "one batched forward per step"
        assert calls[0] == (engine.stats[-1].num_tokens, len(outs))


def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_new_tokens=12, seed=7, ignore_eos=True)
    prompt = mixed_prompts(1, seed=3)[0]
    alone = kv_cache.generate(tiny, prompt, params=params)
    engine = Engine(tiny, num_blocks=20, block_size=4, max_batch_tokens=6)   # preempts and chunks too
    others = [SamplingParams(temperature=1.0, max_new_tokens=9, seed=s, ignore_eos=True) for s in range(5)]
    outs = engine.generate(mixed_prompts(5, seed=4) + [prompt], others + [params])
    assert outs[-1] == alone
    assert_no_leaks(engine)


def test_per_request_params_and_repetition_penalty(tiny):
    prompts = mixed_prompts(4, seed=5)
    params = [SamplingParams(temperature=0, max_new_tokens=n, repetition_penalty=rp, ignore_eos=True)
              for n, rp in ((3, 1.0), (8, 1.3), (1, 1.0), (12, 2.0))]
    expected = [kv_cache.generate(tiny, p, params=sp) for p, sp in zip(prompts, params)]
    engine = Engine(tiny, num_blocks=64, block_size=4, max_batch_tokens=16)
    assert engine.generate(prompts, params) == expected
    assert [len(o) for o in expected] == [3, 8, 1, 12]
    assert_no_leaks(engine)


def test_stops_on_eos_with_the_eos_token_last(tiny):
    prompt = mixed_prompts(1, seed=6)[0]
    free_run = kv_cache.generate(tiny, prompt, params=GREEDY)
    eos = free_run[3]
    model = ts.tiny_model(seed=0, eos_token_ids=(eos,))       # same weights, that token is now EOS
    params = SamplingParams(temperature=0, max_new_tokens=10)
    engine = Engine(model, num_blocks=64, block_size=4)
    rid = engine.add_request(prompt, params)
    engine.run()
    seq = engine.finished[rid]
    assert seq.output_ids == free_run[:free_run.index(eos) + 1] == kv_cache.generate(model, prompt, params=params)
    assert seq.finish_reason == "eos"
    assert_no_leaks(engine)


class LetterTokenizer:
    """Decodes id i to one letter: enough for stop strings on the tiny model."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


def test_stop_strings(tiny):
    tok = LetterTokenizer()
    prompt = mixed_prompts(1, seed=8)[0]
    text = tok.decode(kv_cache.generate(tiny, prompt, params=GREEDY))
    params = SamplingParams(temperature=0, max_new_tokens=10, stop=(text[4:6],), ignore_eos=True)
    engine = Engine(tiny, num_blocks=64, block_size=4, tokenizer=tok)
    rid = engine.add_request(prompt, params)
    engine.run()
    seq = engine.finished[rid]
    assert seq.finish_reason == "stop"
    assert seq.output_ids == kv_cache.generate(tiny, prompt, params=params, tokenizer=tok)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        Engine(tiny, num_blocks=8).add_request(prompt, params)


def test_context_window_ends_a_request(tiny):
    model = ts.tiny_model(seed=0, max_seq_len=40)
    prompt = mixed_prompts(1, seed=9, lo=35, hi=36)[0]
    engine = Engine(model, num_blocks=16, block_size=4)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))[0]
    assert len(out) == 5 and engine.finished[0].finish_reason == "context"
    assert_no_leaks(engine)


def test_impossible_requests_are_refused_and_the_others_continue(tiny):
    engine = Engine(tiny, num_blocks=4, block_size=4)      # 16 positions in the whole pool
    ok = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match="whole pool has 4 blocks"):
        engine.add_request(list(range(3, 20)), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="whole pool"):   # fits as a prompt, but not with its outputs
        engine.add_request([5] * 10, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="context window"):
        engine.add_request([5] * 1025, SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([5, 999], SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request([5], {"temperature": 0})
    engine.run()
    assert engine.finished[ok].output_ids == kv_cache.generate(tiny, [5, 6, 7], 4, SamplingParams(
        temperature=0, ignore_eos=True))
    assert_no_leaks(engine)
    # exactly 16 positions: prompt 13 + 4 outputs - 1 (the last token is never fed back) fits
    engine.generate([[5] * 13], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    assert_no_leaks(engine)


def test_max_kv_positions():
    assert max_kv_positions(3, 4, 1024) == 6      # the last sampled token is never fed back
    assert max_kv_positions(35, 20, 40) == 39     # the context window caps the output
    assert max_kv_positions(16, 5, 16) == 16      # a prompt that fills the window still runs once
    assert max_kv_positions(1, 1, 1) == 1


def test_a_prompt_that_fills_the_context_window_gets_one_token():
    # 16-token prompt, 16-token window: its 16 positions run once to sample one token, as in kv_cache.generate.
    # The KV need used to be computed one short (15 positions = 3 blocks of 5): the request was accepted, and
    # the first step() died with the livelock assertion.
    model = ts.tiny_model(seed=0, max_seq_len=16)
    prompt = mixed_prompts(1, seed=9, lo=16, hi=17)[0]
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    expected = kv_cache.generate(model, prompt, params=params)
    assert len(expected) == 1
    with pytest.raises(ValueError, match="16 KV positions = 4 blocks of 5, but the whole pool has 3 blocks"):
        Engine(model, num_blocks=3, block_size=5).add_request(prompt, params)
    engine = Engine(model, num_blocks=4, block_size=5)
    assert engine.generate([prompt], params) == [expected]
    assert engine.finished[0].finish_reason == "context"
    assert_no_leaks(engine)
    assert list(generate_stream(model, prompt, params=params, block_size=5)) == expected


def test_pop_finished_forgets_a_request(tiny):
    engine = Engine(tiny, num_blocks=16, block_size=4, prefix_caching=True)
    rid = engine.add_request([5] * 10, GREEDY)
    engine.run()
    assert rid in engine.finished and rid in engine.blocks.hits
    seq = engine.pop_finished(rid)
    assert seq.request_id == rid and len(seq.output_ids) == GREEDY.max_new_tokens
    assert rid not in engine.finished and rid not in engine.blocks.hits
    with pytest.raises(KeyError):
        engine.pop_finished(rid)


def test_invalid_engine_arguments(tiny):
    for kwargs in ({"num_blocks": 0}, {"block_size": -1}, {"max_batch_tokens": 0}, {"max_running": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            Engine(tiny, **kwargs)
    with pytest.raises(ValueError, match="backend"):
        Engine(tiny, backend="cuda")
    engine = Engine(tiny, num_blocks=8)
    with pytest.raises(ValueError, match="2 prompts but 1"):
        engine.generate([[5], [6]], [GREEDY])
    with pytest.raises(ValueError, match="out of range"):      # one bad prompt: nothing is queued
        engine.generate([[5], [6, 1000]], GREEDY)
    assert not engine.has_unfinished()


def test_step_outputs_stream_each_token_once(tiny):
    prompts = mixed_prompts(5, seed=10)
    engine = Engine(tiny, num_blocks=30, block_size=4, max_batch_tokens=9)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    streamed: dict[int, list[int]] = {i: [] for i in ids}
    finished = []
    while engine.has_unfinished():
        for out in engine.step():
            assert isinstance(out, StepOutput) and len(out.new_tokens) == 1
            assert out.request_id not in finished
            streamed[out.request_id] += out.new_tokens
            if out.finished:
                finished.append(out.request_id)
                assert out.finish_reason == "length"
    assert sorted(finished) == ids
    assert [streamed[i] for i in ids] == [kv_cache.generate(tiny, p, params=GREEDY) for p in prompts]
    assert_no_leaks(engine)


def test_generate_stream_matches_kv_cache(tiny):
    prompt = mixed_prompts(1, seed=11, lo=50, hi=51)[0]
    params = SamplingParams(temperature=0.7, seed=3, max_new_tokens=30)
    assert list(generate_stream(tiny, prompt, 9, params)) == kv_cache.generate(tiny, prompt, 9, params)
    assert list(generate_stream(tiny, prompt, None, params, max_batch_tokens=16)) == \
        kv_cache.generate(tiny, prompt, params=params)


def test_metrics(tiny):
    engine = Engine(tiny, num_blocks=64, block_size=4, max_batch_tokens=512)
    ids = [engine.add_request(p, GREEDY) for p in mixed_prompts(6, seed=12)]
    engine.run()
    for i in ids:
        m = engine.finished[i].metrics()
        assert 0 <= m.queue_time <= m.ttft
        assert len(m.itl) == m.num_output_tokens - 1 == GREEDY.max_new_tokens - 1
        assert all(d >= 0 for d in m.itl) and m.tokens_per_s > 0
    assert sum(s.num_sampled for s in engine.stats) == 6 * GREEDY.max_new_tokens
    assert max(s.num_seqs for s in engine.stats) == 6
    assert 0 < engine.peak_blocks_used <= 64


def test_describe_shows_block_tables_and_refcounts(tiny):
    engine = Engine(tiny, num_blocks=16, block_size=4, max_batch_tokens=64)
    engine.add_request(list(range(3, 13)), GREEDY)     # 10 tokens -> 3 blocks
    engine.add_request([7, 8], GREEDY)                 # 2 tokens -> 1 block
    engine.step()
    text = engine.describe()
    assert "4/16 blocks used" in text
    assert "r0: 11 tokens (10 in cache), block table [0, 1, 2] (last block 2/4 full)" in text
    assert "r1: 3 tokens (2 in cache), block table [3]" in text
    assert "0:r0" in text and "3:r1" in text and str(engine) == text


# --- the real model ---------------------------------------------------------------------------------------------

@pytest.mark.real
@pytest.mark.slow
def test_smollm2_batch_of_16_matches_kv_cache(smol, smol_tok):
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
             "The three primary colours are", "import numpy as np\n", "Water boils at", "1, 2, 3, 4,",
             "The quick brown fox", "In 1492, Columbus", "Photosynthesis is the process by which plants",
             "Hello! My name is", "Q: What is 2+2?\nA:", "The best way to learn programming is to",
             "Roses are red, violets are blue,", "A haiku about autumn:\n", "SELECT * FROM"]
    prompts = [smol_tok.encode(smol_tok.apply_chat_template([{"role": "user", "content": t}])) if i % 3 == 0
               else smol_tok.encode(t) for i, t in enumerate(texts)]   # 4 .. ~40 tokens
    params = SamplingParams(temperature=0, max_new_tokens=8)
    expected = [kv_cache.generate(smol, p, params=params) for p in prompts]
    for num_blocks, block_size, budget in ((64, 16, 512), (12, 4, 24)):   # roomy; tiny pool + chunked prefill
        engine = Engine(smol, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=budget)
        assert engine.generate(prompts, params) == expected, (num_blocks, block_size, budget)
        assert_no_leaks(engine)
        if num_blocks == 12:
            assert sum(s.num_preempted for s in engine.stats) > 0


@pytest.mark.parametrize("num_blocks, block_size, budget", [CONFIGS["roomy"], CONFIGS["tiny-pool-chunked"]],
                         ids=["roomy", "tiny-pool-chunked"])
def test_numba_backend_matches_too(tiny, tiny_reference, num_blocks, block_size, budget):
    prompts, expected = tiny_reference
    engine = Engine(tiny, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=budget, backend="numba")
    assert engine.generate(prompts, GREEDY) == expected
    assert_no_leaks(engine)


# --- the benchmark (tinyserve/bench.py, `python -m tinyserve bench`) ------------------------------------------

def test_bench_workload_is_reproducible_and_measured(tiny):
    from tinyserve.bench import Workload, format_table, run_workload
    w = Workload(num_requests=5, prompt_len=(3, 30), output_len=(2, 9), seed=4)
    reqs = w.requests(tiny.config.vocab_size)
    assert reqs == w.requests(tiny.config.vocab_size)            # same seed, same work
    r = run_workload(tiny, reqs, progress=False, num_blocks=20, block_size=4, max_batch_tokens=16)
    assert r.output_tokens == sum(p.max_new_tokens for _, p in reqs) and len(r.ttft) == 5
    assert 0 < r.peak_blocks <= 20 and r.tokens_per_s > 0
    assert "TTFT p50 ms" in format_table([r])
    with pytest.raises(ValueError, match="prompt_len"):
        Workload(prompt_len=(0, 4)).requests(256)


def test_bench_cli_prints_the_table(capsys):
    from tinyserve.__main__ import main
    assert main(["bench", "--model", "tiny", "--requests", "3", "--prompt-len", "4:20", "--output-len", "3",
                 "--sweep", "1,2", "--num-blocks", "32", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    for word in ("req/s", "out tok/s", "TTFT p90 ms", "ITL p50 ms", "peak blocks", "batch 2", "B=2"):
        assert word in out
