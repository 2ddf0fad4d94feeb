"""The stable API that notebooks, tests and outside checks use: `import tinyserve as ts` must be enough."""
import numpy as np
import pytest

import tinyserve as ts


def test_top_level_names_reach_every_lesson(tiny):
    ids = [3, 7, 11, 5]
    greedy = ts.SamplingParams(temperature=0.0)
    logits = ts.naive.forward(tiny, ids)
    assert logits.shape == (len(ids), tiny.config.vocab_size) and logits.dtype == np.float32
    out = ts.naive.generate(tiny, ids, max_new_tokens=8, params=greedy)
    assert out == ts.kv_cache.generate(tiny, ids, 8, greedy) == ts.Engine(tiny).generate([ids], greedy)[0]
    assert all(isinstance(t, int) for t in out) and 1 <= len(out) <= 8


@pytest.mark.real
def test_load_model_and_tokenizer_from_the_default_folder(smol, smol_tok):
    model, tok = ts.load_model(), ts.load_tokenizer()
    assert model.config == smol.config and tok.encode("Hello world") == smol_tok.encode("Hello world")
