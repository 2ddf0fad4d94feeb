"""One module decides which forward runs (backend.py), and the quantisation modes are one registry (quant.py).

- model.forward is the NumPy reference whatever the model was loaded for; backend.forward runs the kernels for a
  model loaded for them, and answers "does this model run on the kernels?" in one function that the commands call;
- every mode is a QuantMode in quant.MODES, the CLI's choices are derived from it, and no tinyserve module outside
  the registry compares a mode with a string literal.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest

import tinyserve as ts
from tinyserve import backend, model as model_mod, quant

PKG = Path(ts.__file__).parent
PROMPT = [5, 17, 99, 3, 42, 250, 7, 7, 128, 64, 1, 200]


def causal(layer, q, k, v):
    from tinyserve.layers import causal_attention
    return causal_attention(q, k, v)


def test_runs_on_kernels_only_for_quantised_weights_on_numba():
    base = ts.tiny_model(seed=0)
    assert not backend.runs_on_kernels(base)
    assert not backend.runs_on_kernels(backend.set_backend(base, "none", "numba"))   # only the attention is Numba's
    assert not backend.runs_on_kernels(backend.set_backend(base, "int8", "numpy"))   # the NumPy int8 reference
    assert backend.runs_on_kernels(backend.set_backend(base, "int8", "numba"))


def test_the_reference_forward_knows_nothing_of_the_kernels():
    assert "kv_layout" not in inspect.signature(model_mod.forward).parameters
    fast = backend.set_backend(ts.tiny_model(seed=0), "w8a8", "numba")
    tokens, pos = np.array(PROMPT), np.arange(len(PROMPT))
    ref = model_mod.forward(fast, tokens, pos, causal)
    assert fast.fast is None, "model.forward packed weights for the kernels: it ran the fast path"
    want = model_mod.forward(backend.set_backend(fast, "w8a8", "numpy"), tokens, pos, causal)
    assert np.array_equal(ref, want)
    got = backend.forward(fast, tokens, pos, causal)
    assert fast.fast is not None, "backend.forward did not run the kernels for a model loaded for them"
    np.testing.assert_allclose(got, ref, atol=0.05 * np.abs(ref).max())   # exp32 in SiLU: close, not equal


def test_prepare_packs_once_and_only_for_the_kernels():
    base = ts.tiny_model(seed=0)
    assert backend.prepare(base).fast is None
    fast = backend.prepare(backend.set_backend(base, "int8", "numba"))
    packed = fast.fast
    assert packed is not None and backend.prepare(fast).fast is packed


def test_commands_ask_backend_whether_a_model_runs_on_the_kernels():
    for name in ("generate.py", "bench.py", "chat.py", "server.py"):
        text = (PKG / name).read_text()
        assert "runs_on_kernels(" in text, name
        assert 'backend == "numba" and' not in text, f"{name} decides the path itself"


# --- the quantisation modes --------------------------------------------------------------------------------------

def test_modes_are_one_registry_of_frozen_objects():
    assert quant.QUANT_MODES == tuple(quant.MODES) and quant.QUANT_MODES[0] == model_mod.FLOAT32
    for name, mode in quant.MODES.items():
        assert mode.name == name and quant.get_mode(name) is mode
        with pytest.raises(dataclasses.FrozenInstanceError):
            mode.name = "x"
    assert quant.KERNEL_MODES == tuple(m for m in quant.QUANT_MODES if m != model_mod.FLOAT32)
    assert quant.W4A8.bytes_per_weight < quant.INT8.bytes_per_weight < quant.NONE.bytes_per_weight
    with pytest.raises(ValueError, match="quant must be one of"):
        quant.get_mode("int4")


def test_bytes_per_weight_is_what_a_decode_step_reads():
    base = ts.tiny_model(seed=0, dim=128, intermediate_size=192)
    for name in quant.QUANT_MODES:
        q = quant.quantize_model(base, name)
        mats = [getattr(w, f) for w in q.layers for f in quant.MATRICES]
        n = sum(int(np.prod(m.shape)) for m in mats)
        held = sum(m.nbytes - (m.scale.nbytes if hasattr(m, "scale") else 0) for m in mats)
        assert held / n == pytest.approx(quant.get_mode(name).bytes_per_weight), name


def test_accuracy_bounds_are_the_ones_the_accuracy_tests_hold():
    from tests.test_quant_accuracy import BOUNDS
    assert set(BOUNDS) == set(quant.KERNEL_MODES)
    for name, b in BOUNDS.items():
        mode = quant.get_mode(name)
        assert (mode.top1_min, mode.ppl_ratio_max) == (b["top1"], b["ppl_ratio"]), name


def test_cli_choices_come_from_the_registry():
    from tinyserve.__main__ import build_parser
    from tinyserve.cli_options import QUANTS
    assert QUANTS == (quant.AUTO, *quant.QUANT_MODES)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for cmd in ("generate", "bench", "chat", "serve"):
        assert next(a for a in sub.choices[cmd]._actions if a.dest == "quant").choices == QUANTS
    assert next(a for a in sub.choices["compile"]._actions if a.dest == "quant").choices == [quant.AUTO,
                                                                                             *quant.KERNEL_MODES]


def mode_literals(path: Path) -> list[str]:
    """Where a file compares with, or passes as quant=, a quantisation mode's name spelled as a string."""
    names = set(quant.QUANT_MODES) | {quant.AUTO}
    is_name = lambda n: isinstance(n, ast.Constant) and n.value in names   # noqa: E731
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(is_name(n) for n in (node.left, *node.comparators)):
            found.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, ast.keyword) and node.arg in ("quant", "mode") and is_name(node.value):
            found.append(f"{path.name}:{node.value.lineno}")
        elif isinstance(node, ast.arguments):
            args = [*node.posonlyargs, *node.args][-len(node.defaults):] if node.defaults else []
            found += [f"{path.name}:{d.lineno}" for a, d in zip(args, node.defaults)
                      if a.arg in ("quant", "mode") and is_name(d)]
    return found


def test_no_mode_spelled_as_a_string_outside_the_registry():
    # the registry's own QuantMode(...) lines are the one place a name is spelled; inside quant.py too, code names
    # the objects (W4A8.name, ...)
    found = [hit for p in sorted(PKG.rglob("*.py")) for hit in mode_literals(p)]
    assert not found, f"quant modes spelled as strings outside quant.py's registry: {found}"
