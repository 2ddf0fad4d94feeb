"""Lesson 1's generate: when it stops (EOS, token budget, stop string, context window), what it returns,
bad input, and a coherent answer from the real model."""
from __future__ import annotations

import numpy as np
import pytest

import tinyserve as ts
from tinyserve import naive
from tinyserve.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=12)
PROMPT = [5, 17, 200, 3, 99]   # its greedy continuation has 12 distinct-enough tokens (no early loop)


class LetterTokenizer:
    """Stand-in for a tokenizer on the tiny model: token t decodes to one letter (stop strings need decode)."""
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + t % 26) for t in ids)


@pytest.fixture(scope="module")
def reference_run(tiny):
    """The tiny model's greedy continuation of PROMPT, ignoring EOS."""
    return naive.generate(tiny, PROMPT, params=GREEDY)


def test_greedy_generation_is_argmax_of_the_full_forward(tiny, reference_run):
    assert len(reference_run) == 12
    seq = list(PROMPT)
    for tok in reference_run:
        assert tok == int(np.argmax(naive.forward(tiny, seq)[-1]))
        seq.append(tok)


def test_stream_and_list_agree(tiny, reference_run):
    assert list(naive.generate_stream(tiny, PROMPT, params=GREEDY)) == reference_run
    assert all(isinstance(t, int) for t in reference_run)


def test_stops_on_eos_and_includes_it(reference_run):
    # make the tiny model's 4th greedy token its EOS (same weights, another config): generation must end there
    eos_at = next(i for i in range(3, len(reference_run)) if reference_run[i] not in reference_run[:i])
    eos = reference_run[eos_at]
    model = ts.tiny_model(seed=0, eos_token_ids=(eos,))
    out = naive.generate(model, PROMPT, params=SamplingParams(temperature=0.0, max_new_tokens=12))
    assert out == reference_run[: eos_at + 1] and out[-1] == eos
    # ignore_eos runs on to the budget
    assert naive.generate(model, PROMPT, params=GREEDY) == reference_run


def test_max_new_tokens(tiny, reference_run):
    assert naive.generate(tiny, PROMPT, max_new_tokens=1, params=GREEDY) == reference_run[:1]
    assert naive.generate(tiny, PROMPT, max_new_tokens=5, params=GREEDY) == reference_run[:5]
    # the argument wins over params.max_new_tokens; params.max_new_tokens is the default
    assert len(naive.generate(tiny, PROMPT, params=SamplingParams(temperature=0.0, ignore_eos=True,
                                                                   max_new_tokens=3))) == 3


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_max_new_tokens(tiny, bad):
    with pytest.raises(ValueError, match="max_new_tokens"):
        naive.generate(tiny, PROMPT, max_new_tokens=bad, params=GREEDY)


def test_stop_string(tiny, reference_run):
    tok = LetterTokenizer()
    text = tok.decode(reference_run)
    # a two-letter string that first appears at tokens 4-5 or later
    stop = next(text[i:i + 2] for i in range(4, len(text) - 1) if text[i:i + 2] not in text[:i + 1])
    end = text.index(stop) + 2
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=12, stop=(stop,))
    out = naive.generate(tiny, PROMPT, params=params, tokenizer=tok)
    assert out == reference_run[:end]            # the tokens that complete the stop string are returned
    with pytest.raises(ValueError, match="need a tokenizer"):
        naive.generate(tiny, PROMPT, params=params)


def test_context_window():
    model = ts.tiny_model(seed=0, max_seq_len=16)
    out = naive.generate(model, list(range(10)), max_new_tokens=100, params=GREEDY)
    assert len(out) == 6                          # 10 prompt + 6 new = 16 positions, the whole window
    # a prompt that fills the window still gets one token: its logits come from the last prompt position
    assert len(naive.generate(model, list(range(16)), max_new_tokens=100, params=GREEDY)) == 1
    with pytest.raises(ValueError, match="context window"):
        naive.generate(model, list(range(17)), params=GREEDY)


@pytest.mark.parametrize("ids, match", [
    ([], "empty"), ([3, 256], "out of range"), ([-2], "out of range"), ([1.5], "integers"),
    (["x"], "integers"), ([[1, 2]], "flat list"), ([0] * 1025, "context window"),
])
def test_bad_prompt_ids(tiny, ids, match):
    with pytest.raises(ValueError, match=match):
        naive.generate(tiny, ids, params=GREEDY)


def test_seeded_sampling_is_reproducible(tiny):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_new_tokens=10, ignore_eos=True)
    a = naive.generate(tiny, PROMPT, params=params)
    assert a == naive.generate(tiny, PROMPT, params=params)
    assert a != naive.generate(tiny, PROMPT, params=SamplingParams(temperature=1.0, top_p=0.9, seed=12,
                                                                    max_new_tokens=10, ignore_eos=True))


@pytest.mark.real
def test_real_model_answers_a_chat_question(smol, smol_tok):
    ids = smol_tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = naive.generate(smol, ids, params=SamplingParams(temperature=0.0, max_new_tokens=16))
    text = smol_tok.decode(out, skip_special_tokens=True)
    assert "Paris" in text
    assert out[-1] == smol_tok.eos_id and len(out) < 16   # the instruct model ends its turn with <|im_end|>
