from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import tinyserve as ts
from tinyserve.weights import DEFAULT_WEIGHTS_DIR, weights_problem

# Shared CI machines are slow and noisy: property tests are judged on what they find, never on how fast.
settings.register_profile("tinyserve", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("tinyserve")


@pytest.fixture(scope="session")
def tiny():
    return ts.tiny_model(seed=0)


def _real_weights_dir() -> Path:
    d = Path(os.environ.get("TINYSERVE_WEIGHTS", DEFAULT_WEIGHTS_DIR))
    problem = weights_problem(d)
    if problem:
        # Fail, never skip: a suite that silently skips every real-model test proves nothing.
        pytest.fail(f"this test needs the real SmolLM2 weights, but {problem}. Run `make weights`.", pytrace=False)
    return d


@pytest.fixture(scope="session")
def smol():
    return ts.load_model(_real_weights_dir())


@pytest.fixture(scope="session")
def smol_tok():
    from tinyserve.tokenizer import load_tokenizer
    return load_tokenizer(_real_weights_dir())
