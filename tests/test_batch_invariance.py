"""The same answer under any load: on the default quantised path a sequence's logits are bit-identical however it
is served.

What must hold (kernels/key_chunks.py states the rule that makes it so): the logits of every sampled row of a
request, keyed by the tokens it has seen, are np.array_equal to those it gets decoded alone in an Engine, whatever
- the batch: 1, 3, 8 (fused decode steps), 9 or 16 (the three-call path) sequences at a time;
- the prompt's chunking: max_batch_tokens cuts prompts into chunks that share steps with other sequences' decodes;
- prefix caching: a prompt's shared prefix comes from blocks another request computed;
- preemption: a pool too small for everyone, so sequences are evicted and their K/V recomputed;
- greedy speculative decoding: the verify rows' logits equal the decode rows' (so its tokens are plain decoding's);
- the cache: kv_cache.generate (a contiguous cache, the dense kernels, prompt chunked or not) equals the Engine.
Logits, not tokens: a difference of 1e-7 can hide behind the same argmax for many steps.

The default path is W4A8 on the numba backend (quant="auto" on the real model), every matmul exact integer
arithmetic with a per-row float epilogue. The float32 NumPy reference is exempt: BLAS picks GEMV or GEMM (and its
blocking) by the row count, so its sums depend on the batch; so is nothing else here.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyserve as ts
from tinyserve import backend, kv_cache, quant
from tinyserve.engine import Engine
from tinyserve.kernels.attention import paged_attention_numba
from tinyserve.kernels.dense_attention import causal_attention
from tinyserve.sampling import SamplingParams


# --- the kernels: every way of computing a row gives the same bits --------------------------------------------

@settings(max_examples=20, deadline=None)
@given(S=st.integers(1, 200), cuts=st.lists(st.integers(1, 199), max_size=3), bs=st.sampled_from([1, 4, 16]),
       H=st.sampled_from([16, 64]), seed=st.integers(0, 10**6))
def test_attention_kernels_agree_bit_for_bit(S, cuts, bs, H, seed):
    """S rows of one sequence over its own S keys, computed as: one dense prefill (tiled from 16 rows, the few-rows
    kernel below), dense rows one at a time, one paged prefill over shuffled blocks, the same cut into chunks at
    `cuts`, and S decode rows (one per sequence, the decode kernel): the same bits everywhere."""
    rng = np.random.default_rng(seed)
    N, K = 6, 2
    q = rng.standard_normal((S, N, H)).astype(np.float32) * 2
    k = rng.standard_normal((S, K, H)).astype(np.float32)
    v = rng.standard_normal((S, K, H)).astype(np.float32)
    want = causal_attention(q, k, v)
    rows = np.stack([causal_attention(q[i:i + 1], k[:i + 1], v[:i + 1])[0] for i in range(S)])
    assert np.array_equal(rows, want), "dense: one row at a time != all rows at once"
    nb = -(-S // bs)
    table = rng.permutation(nb)                                            # block i of the sequence -> pool block
    k_pool, v_pool = np.zeros((nb, bs, K, H), np.float32), np.zeros((nb, bs, K, H), np.float32)
    for i in range(nb):
        k_pool[table[i], :len(k[i * bs:(i + 1) * bs])] = k[i * bs:(i + 1) * bs]
        v_pool[table[i], :len(v[i * bs:(i + 1) * bs])] = v[i * bs:(i + 1) * bs]
    tables = table[None].astype(np.int64)
    assert np.array_equal(paged_attention_numba(q, k_pool, v_pool, tables, [S], [0, S]), want), "paged prefill"
    bounds = [0, *sorted({c for c in cuts if c < S}), S]
    chunked = np.concatenate([paged_attention_numba(q[a:b], k_pool, v_pool, tables, [b], [0, b - a])
                              for a, b in zip(bounds, bounds[1:])])
    assert np.array_equal(chunked, want), f"paged prefill in chunks {bounds}"
    decode = paged_attention_numba(q, k_pool, v_pool, np.repeat(tables, S, axis=0), np.arange(1, S + 1),
                                   np.arange(S + 1))
    assert np.array_equal(decode, want), "paged decode rows"


class Recorder:
    """Collects the logits of every row an Engine samples or verifies, keyed by (prompt, the tokens the row has
    seen): the same key in two runs is the same question."""

    def __init__(self):
        self.logits: dict[tuple, np.ndarray] = {}

    def engine(self, model, **kw) -> Engine:
        eng = Engine(model, **kw)
        advance = eng._advance

        def recording_advance(batch, logits):
            row = dict(zip(batch.sampled, batch.logit_starts or range(len(batch.sampled))))
            for b, seq in enumerate(batch.seqs):
                if b not in row:
                    continue
                seen = seq.prompt_ids + seq.output_ids       # a verify's k drafts are the last k output ids
                k = seq.num_drafted
                for j in range(k + 1):                       # row j has seen all but the last k - j drafts
                    ctx = seen[:len(seen) - k + j]
                    self.logits[(tuple(seq.prompt_ids), tuple(ctx))] = logits[row[b] + j].copy()
            return advance(batch, logits)
        eng._advance = recording_advance
        return eng


def engine_logits(model, prompts, params, group: int, **kw) -> tuple[dict, list[Engine]]:
    """Prompts served `group` at a time, each group by a fresh Engine: (logits by key, the engines)."""
    rec, engines = Recorder(), []
    for i in range(0, len(prompts), group):
        eng = rec.engine(model, **kw)
        eng.generate(prompts[i:i + group], params)
        engines.append(eng)
    return rec.logits, engines


def contiguous_logits(model, prompts, n_tokens: int, chunk: int | None = None) -> dict:
    """What kv_cache.generate computes (greedy), keyed the same way."""
    out = {}
    for p in prompts:
        cache = kv_cache.KVCache.allocate(model.config, len(p) + n_tokens)
        ctx = list(p)
        logits = kv_cache.prefill(model, cache, p, chunk)
        for _ in range(n_tokens):
            out[(tuple(p), tuple(ctx))] = logits.copy()
            ctx.append(int(np.argmax(logits)))
            logits = kv_cache.forward_with_cache(model, cache, [ctx[-1]])[0]
    return out


def assert_same_logits(want: dict, got: dict, what: str) -> None:
    missing = [k for k in want if k not in got]
    assert not missing, f"{what}: {len(missing)} of {len(want)} rows never computed (tokens differ?)"
    differ = [k for k in want if not np.array_equal(want[k], got[k])]
    assert not differ, (f"{what}: {len(differ)} of {len(want)} rows' logits differ, first by "
                        f"{np.abs(want[differ[0]] - got[differ[0]]).max():.3g}")


# --- the tiny model: the whole matrix --------------------------------------------------------------------------

N_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=N_TOKENS)


@pytest.fixture(scope="module")
def tiny_w4a8():
    return backend.set_backend(quant.quantize_model(ts.tiny_model(seed=0), "w4a8"), "w4a8", "numba")


@pytest.fixture(scope="module")
def prompts():
    """16 prompts of 30-75 tokens (so contexts cross the 64-key chunks), the first 24 tokens shared (prefix cache
    hits at block sizes up to 8), some with repeats (the n-gram drafter finds drafts)."""
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 250, 24).tolist()
    out = []
    for i in range(16):
        tail = rng.integers(3, 250, int(rng.integers(6, 52))).tolist()
        out.append(shared + (tail[:4] * 3 if i % 3 == 0 else []) + tail)
    return out


@pytest.fixture(scope="module")
def alone(tiny_w4a8, prompts):
    """The reference: every prompt alone in an Engine of default settings."""
    return engine_logits(tiny_w4a8, prompts, GREEDY, group=1)[0]


@pytest.mark.parametrize("batch", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("max_batch_tokens", [7, 64, 512])
def test_logits_do_not_depend_on_batch_or_chunking(tiny_w4a8, prompts, alone, batch, max_batch_tokens):
    got, _ = engine_logits(tiny_w4a8, prompts, GREEDY, batch, max_batch_tokens=max_batch_tokens, block_size=8)
    assert_same_logits(alone, got, f"B={batch}, max_batch_tokens={max_batch_tokens}")


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_prefix_cache_hits_give_the_same_logits(tiny_w4a8, prompts, alone, block_size):
    got, engines = engine_logits(tiny_w4a8, prompts, GREEDY, 16, prefix_caching=True, block_size=block_size,
                                 max_batch_tokens=96)
    assert engines[0].blocks.cache.stats.hit_tokens > 0, "no prefix cache hit: nothing here came from the cache"
    assert_same_logits(alone, got, f"prefix caching, block size {block_size}")


def test_preemption_and_recompute_give_the_same_logits(tiny_w4a8, prompts, alone):
    got, engines = engine_logits(tiny_w4a8, prompts, GREEDY, 16, num_blocks=40, block_size=8)
    assert sum(s.num_preempted for s in engines[0].stats) > 0, "nothing was preempted: enlarge the batch"
    assert_same_logits(alone, got, "preempted")


@pytest.mark.parametrize("draft_k", [2, 4])
def test_greedy_speculative_verify_rows_equal_decode_rows(tiny_w4a8, prompts, alone, draft_k):
    got, engines = engine_logits(tiny_w4a8, prompts, GREEDY, 16, speculative="ngram", draft_k=draft_k)
    assert sum(s.num_drafted for s in engines[0].stats) > 0, "nothing drafted: the test checks no verify row"
    assert_same_logits(alone, got, f"speculative ngram k={draft_k}")


@pytest.mark.parametrize("chunk", [None, 5, 64])
def test_contiguous_cache_equals_the_engine(tiny_w4a8, prompts, alone, chunk):
    """kv_cache.generate (dense kernels: the tiled one for >= 16 rows, the few-rows one below) = the paged Engine."""
    assert_same_logits(alone, contiguous_logits(tiny_w4a8, prompts, N_TOKENS, chunk), f"kv_cache, chunk {chunk}")


# --- the real model: a few prompts -----------------------------------------------------------------------------

REAL_QUESTIONS = ["What is a prime number?", "Name a colour of the sky at dusk.", "How do bees make honey?",
                  "Why is snow white?", "What does a compiler do?", "Describe a cat in five words.",
                  "What is the capital of Italy?", "How far away is the Moon?", "Is a tomato a fruit?"]


def test_real_model_logits_do_not_depend_on_the_batch(smol, smol_tok):
    """SmolLM2 on quant="auto": 9 chat prompts alone, 9 together (the three-call path), 3 at a time (fused steps)
    with prefix caching and chunked prompts, and through kv_cache: the same logits, bit for bit."""
    model = backend.set_backend(smol, "auto", "numba")
    prompts = [smol_tok.encode_chat([{"role": "user", "content": q}]) for q in REAL_QUESTIONS]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=8)
    want, _ = engine_logits(model, prompts, params, 1)
    assert_same_logits(want, engine_logits(model, prompts, params, 9)[0], "B=9")
    assert_same_logits(want, engine_logits(model, prompts, params, 3, prefix_caching=True, max_batch_tokens=24)[0],
                       "B=3, prefix caching, chunked")
    assert_same_logits(want, contiguous_logits(model, prompts, 8), "kv_cache")
