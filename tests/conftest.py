from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import tinyserve as ts
from tinyserve.weights import DEFAULT_WEIGHTS_DIR, weights_problem

# Shared CI machines are slow and noisy: property tests are judged on what they find, never on how fast.
settings.register_profile("tinyserve", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("tinyserve")

# A shell starts a background job (`make test &`, nohup) with SIGINT ignored, and Python then installs no Ctrl-C
# handler: the tests of what Ctrl-C does would fail for a reason that is not the engine's. Give the suite Python's
# own handler back; a process the tests start inherits it as the default (exec resets a caught signal, not an
# ignored one), so the CLI's Ctrl-C test sees what a terminal user sees.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


_variants_module = None       # tests/test_isa_variants.py once its compiles have started, and their folder
_variants_folder: Path | None = None


def pytest_collection_finish(session):
    """The kernel variants other than this CPU's own compile from an empty cache for minutes, each in one thread:
    start them now, at idle priority, so they compile while the rest of the suite runs instead of holding it up when
    their test comes (tests/test_isa_variants.py)."""
    global _variants_module, _variants_folder
    item = next((i for i in session.items        # a test of the variants' results: its module starts them
                 if "native" in getattr(i, "fixturenames", ()) and hasattr(i.module, "start_variants")), None)
    if item is not None and not session.config.option.collectonly:
        _variants_module, _variants_folder = item.module, Path(tempfile.mkdtemp(prefix="tinyserve-variants-"))
        _variants_module.start_variants(_variants_folder, only_others=True)


def pytest_sessionfinish(session):
    """No variant outlives the suite (the run stopped before their test, or it was deselected after collection)."""
    if _variants_module is not None:
        _variants_module.stop_variants()
        shutil.rmtree(_variants_folder, ignore_errors=True)


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


def _gemma_gguf() -> Path:
    """The Gemma 3 270M GGUF (`make weights-gemma`, or TINYSERVE_GEMMA_GGUF): fail, never skip, without it."""
    from tinyserve.zoo import GEMMA3_270M
    env = os.environ.get("TINYSERVE_GEMMA_GGUF")
    for p in ([Path(env)] if env else []) + [GEMMA3_270M.path]:
        if p.is_file():
            return p
    pytest.fail("this test needs the Gemma 3 270M GGUF: run `make weights-gemma` (or set TINYSERVE_GEMMA_GGUF "
                "to its path)", pytrace=False)


@pytest.fixture(scope="session")
def gemma_fast():
    """Gemma 3 270M on the fast path (quant auto, numba: kernels/block_forward.py), loaded once for every test."""
    from tinyserve.backend import prepare
    return prepare(ts.load_model(_gemma_gguf(), quant="auto", backend="numba"))
