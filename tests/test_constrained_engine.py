"""Constrained decoding inside the Engine, on the tiny model and its character tokenizer: the outputs follow the
grammar, and with greedy decoding they are token for token what an independent loop makes (the whole prefix run
through the model at every token, the mask found by reading each token's bytes with the automaton): whatever the
batch, preemption, prefix caching, speculation or jump-forward do."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

import tinyserve as ts
from tinyserve import naive
from tinyserve.constrained import Automaton, compile_schema
from tinyserve.engine import Engine
from tinyserve.sampling import SamplingParams
from tinyserve.tokenizer import CharTokenizer

TOK = CharTokenizer()
SCHEMAS = [
    {"type": "object", "properties": {"name": {"enum": ["Ann", "Bob", "Zoë"]}, "age": {"type": "integer"},
                                      "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["name", "age"]},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                 "kind": {"enum": ["a", "b", None]}},
                                "required": ["id", "kind"]}, "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "n": {"type": "null"}}, "required": ["flag"]},
]
PROMPTS = [[5, 6, 7], [9] * 20, list(range(40, 75)), [100, 3, 77, 12]]


def reference(model, prompt: list[int], schema, max_new: int = 40) -> list[int]:
    """Greedy constrained decoding the slow, obvious way: no cache, no trie, no jump-forward."""
    a = Automaton(compile_schema(schema))
    sid, out = a.start, []
    while len(out) < max_new and not (a.is_complete(sid) and not a.next_bytes(sid)):
        logits = naive.next_token_logits(model, np.array(prompt + out))                       # [V]
        allowed = [i for i in range(3, 256) if a.walk(sid, chr(i).encode()) != -1]
        allowed += [2] if a.is_complete(sid) else []
        token = max(allowed, key=lambda i: logits[i])
        out.append(token)
        if token == 2:
            break
        sid = a.walk(sid, chr(token).encode())
    return out


@pytest.fixture(scope="module")
def expected(tiny):
    return {(p, s): reference(tiny, PROMPTS[p], SCHEMAS[s]) for p in range(len(PROMPTS)) for s in range(len(SCHEMAS))}


def greedy(schema, max_new=40):
    return SamplingParams(temperature=0, max_new_tokens=max_new, json_schema=schema)


CONFIGS = {"roomy": {}, "tiny-pool-preempts": dict(num_blocks=24, block_size=4, max_batch_tokens=64),
           "prefix-caching": dict(num_blocks=64, block_size=4, prefix_caching=True),
           "one-token-per-step": dict(max_batch_tokens=1),
           "ngram-speculation": dict(speculative="ngram", draft_k=4)}


@pytest.mark.parametrize("options", CONFIGS.values(), ids=CONFIGS.keys())
def test_engine_greedy_equals_the_slow_reference(tiny, expected, options):
    engine = Engine(tiny, tokenizer=TOK, **options)
    keys = list(expected)
    if options.get("prefix_caching"):      # each prompt twice in a row: the second run starts from cached blocks
        outs = [engine.generate([PROMPTS[p]] * 2, greedy(SCHEMAS[s])) for p, s in keys]
        assert all(a == b for a, b in outs)
        outs = [a for a, _ in outs]
    else:
        outs = engine.generate([PROMPTS[p] for p, _ in keys], [greedy(SCHEMAS[s]) for _, s in keys])
    assert outs == [expected[k] for k in keys]
    if options.get("num_blocks") == 24:
        assert sum(s.num_preempted for s in engine.stats) > 0, "this pool is meant to force preemption"
    if engine.speculator is not None:      # drafts were made, and some cut or rejected by the grammar's mask
        assert engine.speculator.stats.drafted > engine.speculator.stats.accepted > 0
    finished = 0
    for (p, s), out in zip(keys, outs):
        if len(out) < 40:                  # not cut off by max_new_tokens (a random model may write digits forever)
            jsonschema.validate(json.loads(TOK.decode(out)), SCHEMAS[s])
            finished += 1
    assert finished >= len(keys) // 2


def test_jump_forward_runs_forced_text_without_a_step_per_token(tiny):
    """A schema of long forced keys: the forced characters join the output without being sampled, so the request
    needs far fewer engine steps than it has tokens."""
    schema = {"type": "object", "properties": {"the_first_very_long_property_name": {"type": "boolean"},
                                               "and_another_quite_long_property_name": {"type": "boolean"}},
              "required": ["the_first_very_long_property_name", "and_another_quite_long_property_name"]}
    engine = Engine(tiny, tokenizer=TOK)
    out = engine.generate([[5, 6, 7]], greedy(schema, 200))[0]
    assert json.loads(TOK.decode(out)).keys() == schema["properties"].keys()
    assert len(engine.stats) < len(out) / 4
    assert out == reference(tiny, [5, 6, 7], schema, 200)


def test_sampling_stays_inside_the_grammar_and_mixes_with_free_text(tiny):
    engine = Engine(tiny, tokenizer=TOK)
    params = [SamplingParams(temperature=t, top_p=tp, top_k=k, min_p=mp, repetition_penalty=rp, seed=i,
                             max_new_tokens=60, json_schema=SCHEMAS[i % 3])
              for i, (t, tp, k, mp, rp) in enumerate([(1.0, 1.0, 0, 0.0, 1.0), (1.5, 0.9, 0, 0.0, 1.0),
                                                      (0.8, 1.0, 20, 0.0, 1.3), (2.0, 1.0, 0, 0.05, 1.0)] * 3)]
    free = SamplingParams(temperature=1.0, seed=3, max_new_tokens=20, ignore_eos=True)
    outs = engine.generate(PROMPTS * 3 + [PROMPTS[0]], params + [free])
    for out, p in zip(outs, params):
        jsonschema.validate(json.loads(TOK.decode(out)), p.json_schema)
    assert len(outs[-1]) == 20                              # the unconstrained neighbour is untouched
    assert len({TOK.decode(o) for o in outs[:-1]}) > 3      # sampling still samples


def test_the_request_ends_when_the_value_is_complete(tiny):
    engine = Engine(tiny, tokenizer=TOK)
    rid = engine.add_request([5, 6], greedy({"type": "boolean"}))
    engine.run()
    seq = engine.finished[rid]
    assert TOK.decode(seq.output_ids) in ("true", "false") and seq.finish_reason == "stop"
    # a budget too small for the value: it ends by length, cut off (not silently "completed")
    rid = engine.add_request([5, 6], greedy(SCHEMAS[0], 5))
    engine.run()
    assert engine.finished[rid].finish_reason == "length" and len(engine.finished[rid].output_ids) == 5


def test_bad_requests_are_refused(tiny):
    with pytest.raises(ValueError, match="tokenizer"):
        Engine(tiny).add_request([5], greedy(True))
    with pytest.raises(ValueError, match="oneOf"):
        SamplingParams(json_schema={"oneOf": [{"type": "string"}, {"enum": ["a", 1]}]})
    with pytest.raises(ValueError, match="not JSON"):
        SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": {1, 2}}}})
