"""The first half of lesson 8's disaggregated hand-over, shared by the tests that check the second half: one engine
prefills a prompt and exports its K/V; the test then adopts it into another engine and decodes."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyserve.engine import Engine
from tinyserve.model import Model
from tinyserve.orchestrators import export_kv
from tinyserve.sampling import SamplingParams
from tinyserve.sequence import Sequence


@dataclass(slots=True)
class Prefilled:
    expect: list[int]        # the tokens one engine gives when it prefills and decodes the prompt alone
    seq: Sequence            # the prefill engine's sequence, its K/V still held
    first: int               # the first new token, sampled by the prefill engine
    k: np.ndarray            # [L, T, N_kv, H] the prompt's keys, exported
    v: np.ndarray            # [L, T, N_kv, H]


def prefill_and_export(model: Model, prompt: list[int], params: SamplingParams, block_size: int) -> Prefilled:
    expect = Engine(model, num_blocks=64).generate([prompt], params)[0]
    pre = Engine(model, num_blocks=64, block_size=block_size)
    rid = pre.add_request(prompt, params)
    while not (outs := pre.step()):
        pass
    seq = pre.sequence(rid)
    k, v = export_kv(pre, seq, len(prompt))
    assert k.shape == (model.config.n_layers, len(prompt), model.config.n_kv_heads, model.config.head_dim)
    return Prefilled(expect, seq, outs[0].new_tokens[0], k, v)
