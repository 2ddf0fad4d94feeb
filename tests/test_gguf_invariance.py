"""Batch invariance for every format a learner downloads: tests/test_batch_invariance.py's guarantees, held by
SmolLM2-135M-Instruct as llama.cpp's quantizer writes it (Q4_0, Q4_1, Q4_K_M, Q5_K_M, Q6_K, Q8_0, F16), each loaded
from its own GGUF on the default path (quant="auto", numba): a sequence's logits are bit-identical alone, at B=16,
and 4 at a time with prefix caching and chunked prompts.

The files are not in the repository (100-260 MB each): $TINYSERVE_GGUF_DIR names the folder that holds them
(`SmolLM2-135M-Instruct.<FORMAT>.gguf`, made from the shipped Q4_1 by tools/peers/quantize_gguf.py or
tools/make_gguf_fixtures.py's requantize; docs/your-own-model.md says how). Without the variable the tests are
skipped, saying so; with it, a missing file fails.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import tinyserve as ts
from tinyserve.sampling import SamplingParams
from tests.test_batch_invariance import assert_same_logits, engine_logits

FORMATS = ("Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16")
GGUF_DIR = os.environ.get("TINYSERVE_GGUF_DIR")
QUESTIONS = ["What is a prime number?", "Name a colour of the sky at dusk.", "How do bees make honey?",
             "Why is snow white?", "What does a compiler do?", "Describe a cat in five words.",
             "What is the capital of Italy?", "How far away is the Moon?", "Is a tomato a fruit?",
             "Why do we dream?", "What is a verb?", "How many legs does a spider have?",
             "Who wrote Hamlet?", "Why is the sea blue?", "What is rain made of?", "Say hello in French."]

pytestmark = [pytest.mark.real, pytest.mark.slow,
              pytest.mark.skipif(not GGUF_DIR, reason="set TINYSERVE_GGUF_DIR to the folder of the SmolLM2 GGUFs "
                                                      "(docs/your-own-model.md) to check batch invariance per format")]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_gives_the_same_logits_alone_batched_and_prefix_cached(fmt):
    path = Path(GGUF_DIR) / f"SmolLM2-135M-Instruct.{fmt}.gguf"
    assert path.is_file(), f"{path} is missing (TINYSERVE_GGUF_DIR={GGUF_DIR})"
    tok = ts.load_tokenizer(path)
    model = ts.load_model(path, quant="auto", backend="numba")
    assert model.backend == "numba"                      # llama's block runs on the kernels: nothing to fall back on
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=8)
    want, _ = engine_logits(model, prompts, params, 1)
    assert_same_logits(want, engine_logits(model, prompts, params, 16)[0], f"{fmt} ({model.quant}): B=16")
    assert_same_logits(want, engine_logits(model, prompts, params, 4, prefix_caching=True, max_batch_tokens=24)[0],
                       f"{fmt} ({model.quant}): B=4, prefix caching, chunked")
