"""Prefix caching inside the Engine: the same greedy outputs with the cache on and off (after evictions and
preemptions too), the classic traps, the metrics, and the multi-turn chat loop."""
from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tinyserve.cache_base import NoPrefixCache
from tinyserve.engine import Engine
from tinyserve.prefix_cache import PrefixMetrics, cached_prefixes
from tinyserve.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


def shared_prompts(seed=0, n=8, system_len=40, vocab=256):
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(3, vocab, system_len)]
    prompts = [system + [int(t) for t in rng.integers(3, vocab, rng.integers(1, 20))] for _ in range(n)]
    return prompts + [list(system), system[:33]]          # a prompt that is all system prompt, and a prefix of it


def block_prefixes(cache) -> dict[int, tuple[int, ...]]:
    """{block: the token prefix whose last block's K/V it caches} over the whole trie."""
    return {block: prefix for prefix, block in cached_prefixes(cache.root, cache.block_size).items()}


def assert_no_leaks(engine):
    """Idle engine: every used block is cached and only the cache holds it; clearing the cache frees them all."""
    alloc, cache = engine.blocks.allocator, engine.blocks.cache
    alloc.check()
    cache.check()
    assert alloc.num_used == cache.num_cached == cache.num_evictable
    cache.clear()
    assert alloc.num_free == alloc.num_blocks


@pytest.mark.parametrize("num_blocks,block_size,budget", [
    (200, 4, 64),     # room for everything: nothing evicted
    (30, 4, 32),      # tight: evictions and preemptions
    (24, 4, 16),      # tighter, with chunked prefill
    (64, 8, 512),     # one-step prefills
])
def test_outputs_identical_with_cache_on_and_off(tiny, num_blocks, block_size, budget):
    prompts = shared_prompts()
    off = Engine(tiny, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=budget).generate(prompts, GREEDY)
    engine = Engine(tiny, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=budget, prefix_caching=True)
    assert engine.generate(prompts, GREEDY) == off
    assert engine.generate(prompts, GREEDY) == off          # again, now from a warm cache
    m = PrefixMetrics.of(engine)
    assert m.hit_tokens > 0
    if num_blocks <= 30:
        assert m.blocks_evicted > 0 and sum(s.num_preempted for s in engine.stats) > 0   # the tight cases are tight
    assert_no_leaks(engine)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(12, 40),
       budget=st.sampled_from([4, 8, 64]))
def test_random_shared_workloads_match_cache_off(tiny, data, block_size, num_blocks, budget):
    base = data.draw(st.lists(st.integers(3, 9), min_size=1, max_size=12))
    prompts = data.draw(st.lists(st.builds(lambda k, tail: base[:k] + tail, st.integers(0, len(base)),
                                           st.lists(st.integers(3, 9), max_size=6)).filter(bool),
                                 min_size=1, max_size=6))
    params = SamplingParams(temperature=0, max_new_tokens=data.draw(st.integers(1, 6)), ignore_eos=True)
    if any(len(p) + params.max_new_tokens - 1 > num_blocks * block_size for p in prompts):
        return                                             # a request the pool could never hold
    off = Engine(tiny, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=budget).generate(prompts, params)
    engine = Engine(tiny, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=budget, prefix_caching=True)
    assert engine.generate(prompts, params) == off
    assert engine.generate(prompts[::-1], params) == off[::-1]
    assert_no_leaks(engine)


def test_fully_cached_prompt_still_runs_its_last_token(tiny):
    prompt = shared_prompts()[0][:32]                      # exactly 8 blocks of 4
    engine = Engine(tiny, num_blocks=64, block_size=4, prefix_caching=True)
    first = engine.generate([prompt], GREEDY)
    second = engine.generate([prompt], GREEDY)             # all 8 blocks are cached now
    assert second == first
    assert engine.blocks.hits[1] == (28, 32)               # 7 blocks hit; the block with the last token reruns
    tokens_run = [s.num_tokens for s in engine.stats]
    assert tokens_run[len(tokens_run) - GREEDY.max_new_tokens] == 4   # second request's first step: 1 block


def test_identical_prompts_in_the_same_step_share_blocks(tiny):
    prompt = shared_prompts()[1]
    n_blocks = -(-len(prompt) // 4)
    off = Engine(tiny, num_blocks=64, block_size=4)
    expected = off.generate([prompt, prompt], GREEDY)
    on = Engine(tiny, num_blocks=64, block_size=4, prefix_caching=True)
    assert on.generate([prompt, prompt], GREEDY) == expected
    # the second waited one step for the first's prefill, then took its blocks: the prompt is stored once
    assert on.blocks.hits[1][0] == (len(prompt) - 1) // 4 * 4
    assert on.peak_blocks_used < off.peak_blocks_used
    assert on.peak_blocks_used <= n_blocks + 2 * (-(-GREEDY.max_new_tokens // 4) + 1)


def test_a_shared_prefix_is_stored_once_while_requests_run(tiny):
    prompts = shared_prompts(n=6, system_len=64)[:6]
    engine = Engine(tiny, num_blocks=128, block_size=4, prefix_caching=True)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    shared_max = 0
    while engine.has_unfinished():
        engine.step()
        shared_max = max(shared_max, PrefixMetrics.of(engine).blocks_shared)
        tables = [engine.sequence(i).block_table for i in ids if engine.sequence(i).block_table]
        if len(tables) >= 2:
            assert len({tuple(t[:16]) for t in tables}) == 1   # the 16 system-prompt blocks: one physical copy
    assert shared_max == 16


def test_evicted_blocks_are_reused_without_stale_hits(tiny):
    prompts = shared_prompts(seed=3)
    rng = np.random.default_rng(7)
    others = [[int(t) for t in rng.integers(3, 256, 30)] for _ in range(6)]   # no sharing: pushes the first out
    ref = Engine(tiny, num_blocks=40, block_size=4)
    expected = ref.generate(prompts[:2], GREEDY) + ref.generate(others, GREEDY) + ref.generate(prompts[:2], GREEDY)
    engine = Engine(tiny, num_blocks=40, block_size=4, prefix_caching=True)
    got = engine.generate(prompts[:2], GREEDY)
    before = block_prefixes(engine.blocks.cache)
    got += engine.generate(others, GREEDY)
    after = block_prefixes(engine.blocks.cache)
    assert engine.blocks.cache.stats.evicted_blocks > 0
    assert any(b in after and after[b] != p for b, p in before.items())   # a block now caches other tokens
    got += engine.generate(prompts[:2], GREEDY)
    assert got == expected
    assert_no_leaks(engine)


def test_metrics_count_hits_per_request_and_overall(tiny):
    prompts = shared_prompts(n=4)[:4]
    engine = Engine(tiny, num_blocks=128, block_size=4, prefix_caching=True)
    engine.generate(prompts[:1], GREEDY)
    engine.generate(prompts[1:], GREEDY)
    m = PrefixMetrics.of(engine)
    assert m.per_request[0] == (0, len(prompts[0]))
    for rid in (1, 2, 3):
        hit, n = m.per_request[rid]
        assert n == len(prompts[rid]) and hit >= 40 // 4 * 4 - 4 and hit % 4 == 0
    assert m.hit_tokens == sum(h for h, _ in m.per_request.values())
    assert m.prompt_tokens == sum(len(p) for p in prompts)
    assert 0 < m.hit_rate < 1 and "prompt tokens from cache" in str(m)
    with pytest.raises(ValueError, match="prefix caching off"):
        PrefixMetrics.of(Engine(tiny, num_blocks=8, block_size=4))


def test_caching_off_by_default(tiny):
    engine = Engine(tiny, num_blocks=32, block_size=4)
    engine.generate(shared_prompts()[:2], GREEDY)
    # off means a cache that never hits (a null object) and keeps nothing
    assert not engine.blocks.prefix_caching and isinstance(engine.blocks.cache, NoPrefixCache)
    assert engine.blocks.cache.stats.hit_tokens == 0 and engine.blocks.cache.num_cached == 0
    assert engine.blocks.allocator.num_used == 0
    with pytest.raises(ValueError, match="prefix caching off"):
        PrefixMetrics.of(engine)


# --- the real model ----------------------------------------------------------------------------------------------

@pytest.mark.real
def test_smollm2_shared_system_prompt_identical_on_and_off(smol, smol_tok):
    system = ("You are a meticulous assistant for a hardware store. Answer briefly, name the aisle, and never "
              "invent products. ") * 3
    questions = ["Where are the hammers?", "Do you sell paint?", "I need screws for wood.", "Where is the glue?"]
    prompts = [smol_tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    params = SamplingParams(temperature=0, max_new_tokens=6)
    for num_blocks, budget in ((64, 128), (8, 32)):     # ample, then so tight that it evicts and preempts
        off = Engine(smol, num_blocks=num_blocks, block_size=16, max_batch_tokens=budget).generate(prompts, params)
        engine = Engine(smol, num_blocks=num_blocks, block_size=16, max_batch_tokens=budget, prefix_caching=True)
        assert engine.generate(prompts, params) == off, num_blocks
        assert engine.generate(prompts[::-1], params) == off[::-1], num_blocks
        m = PrefixMetrics.of(engine)
        assert m.hit_rate > 0.5, str(m)
        if num_blocks == 8:
            assert m.blocks_evicted > 0
        assert_no_leaks(engine)


@pytest.mark.real
def test_chat_reuses_the_conversation(smol, smol_tok):
    from tinyserve.chat import chat_loop
    engine = Engine(smol, num_blocks=64, block_size=16, max_batch_tokens=256, prefix_caching=True)
    out, err = io.StringIO(), io.StringIO()
    params = SamplingParams(temperature=0, max_new_tokens=8)
    turns = chat_loop(engine, smol_tok, ["What is 2+2?\n", "\n", "And 3+3?\n", "/quit\n", "never read\n"], params,
                      out=out, err=err)
    assert len(turns) == 2 and out.getvalue().strip()
    first, second = turns
    assert first.cached_tokens == 0
    # the whole first turn (prompt + reply) was cached, up to the last partial block
    assert second.cached_tokens >= (first.prompt_tokens + first.output_tokens) // 16 * 16 - 16
    assert "[turn 2:" in err.getvalue() and "from cache" in err.getvalue()


@pytest.mark.real
def test_chat_survives_a_message_it_cannot_serve(smol, smol_tok):
    from tinyserve.chat import chat_loop
    engine = Engine(smol, num_blocks=8, block_size=16, max_batch_tokens=256, prefix_caching=True)  # 128 positions
    out, err = io.StringIO(), io.StringIO()
    params = SamplingParams(temperature=0, max_new_tokens=4)
    lines = ["Hi\x04\n", "word " * 200 + "\n", "Say hi.\n"]   # untokenizable; larger than the pool; fine
    turns = chat_loop(engine, smol_tok, lines, params, out=out, err=err)
    assert len(turns) == 1 and turns[0].output_tokens >= 1
    log = err.getvalue()
    assert "[error: the text contains '\\x04'" in log and "does not fit the context" in log and "[turn 1:" in log
    assert not engine.has_unfinished() and engine.blocks.allocator.num_used == engine.blocks.cache.num_cached


@pytest.mark.real
def test_chat_cli_reads_stdin_until_eof(smol, monkeypatch, capsys):
    from tinyserve.__main__ import main
    monkeypatch.setattr("sys.stdin", io.StringIO("Say hi.\nSay bye.\n"))   # EOF after two turns
    assert main(["chat", "--max-new-tokens", "4", "--num-blocks", "32"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "[turn 1:" in err and "[turn 2:" in err and "[turn 3:" not in err


def test_chat_cli_rejects_bad_options(capsys):
    from tinyserve.__main__ import main
    assert main(["chat", "--max-new-tokens", "0"]) == 2
    assert "max_new_tokens" in capsys.readouterr().err


def test_bench_shared_prefix_workload():
    from tinyserve.bench import Workload
    plain = Workload(num_requests=4, prompt_len=(3, 9), output_len=(2, 4), seed=1).requests(256)
    shared = Workload(num_requests=4, prompt_len=(3, 9), output_len=(2, 4), seed=1, shared_prefix=50).requests(256)
    prefix = shared[0][0][:50]
    for (p, sp), (q, sq) in zip(plain, shared):
        assert q == prefix + p and sq == sp          # the same workload behind one common prefix
    with pytest.raises(ValueError, match="shared_prefix"):
        Workload(shared_prefix=-1).requests(256)
