"""The OpenAI-compatible server against live servers on loopback: the real `openai` client and plain HTTP (httpx).

Most tests serve the tiny random model (its tokenizer maps id i to chr(i)), so the whole file runs in well under two
minutes; a few `real` tests serve SmolLM2. The load test drives 48 concurrent streaming clients through a few
hundred requests, some hanging up mid-stream, and checks that nothing is lost: every request completes or is
cancelled, greedy outputs equal the offline Engine's, and no KV block is leaked.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

import tinyserve as ts
from tinyserve.engine import Engine
from tinyserve.http_guard import HttpLimits
from tinyserve.loadgen import ClientRequest, drive
from tinyserve.protocol import TextStream, parse_sse
from tinyserve.sampling import SamplingParams
from tinyserve.server import CharTokenizer, ServerThread, create_app

ROOT = Path(__file__).resolve().parents[1]
TOK = CharTokenizer()


class SlowEngine(Engine):
    """The tiny model at the pace of a big one (20 ms a step), so that requests stay in flight long enough to
    see a queue fill up."""
    def step(self):
        time.sleep(0.02)
        return super().step()


def tiny_app(num_blocks=128, max_running=16, max_waiting=64, max_batch_tokens=128, prefix_caching=True,
             engine_class=Engine, limits=None, tokenizer=TOK):
    engine = engine_class(ts.tiny_model(seed=0), num_blocks=num_blocks, block_size=16, max_batch_tokens=max_batch_tokens,
                    max_running=max_running, tokenizer=tokenizer, prefix_caching=prefix_caching)
    return create_app(engine, tokenizer, "tiny", max_waiting=max_waiting, limits=limits)


def offline(prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """The same requests through a fresh Engine, no server: the reference outputs."""
    return Engine(ts.tiny_model(seed=0), num_blocks=512, block_size=16, tokenizer=TOK).generate(prompts, params)


def health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=10).json()


def wait_idle(srv, timeout=30.0) -> dict:
    """/health once the server has no request left in it (the engine thread frees blocks between steps)."""
    t0 = time.perf_counter()
    while True:
        h = health(srv)
        if h["live_requests"] == 0 and h["running"] == 0 and h["waiting"] == 0:
            return h
        if time.perf_counter() - t0 > timeout:
            raise AssertionError(f"the server still holds requests after {timeout} s: {h}")
        time.sleep(0.05)


def assert_no_leak(srv) -> None:
    """Zero blocks held by requests; whatever is still allocated is only the prefix cache's (refcount 1)."""
    h = wait_idle(srv)
    assert h["kv_blocks_used"] == 0 and h["queued"] == 0, h
    engine = srv.app.state.engine
    alloc = engine.blocks.allocator
    alloc.check()
    cache = engine.blocks.cache
    assert alloc.num_used == (cache.num_cached if cache is not None else 0)
    assert all(alloc.refcount[b] == 1 for b in (cache.cached if cache is not None else ()))


@pytest.fixture(scope="module", autouse=True)
def one_blas_thread():
    """The tiny model's matmuls are far too small for two BLAS threads: on a busy 2-core machine their hand-offs
    made a step ~8x slower. (OpenBLAS's thread count is process-wide, hence a module fixture.)"""
    from threadpoolctl import threadpool_limits
    with threadpool_limits(1):
        yield


@pytest.fixture(scope="module")
def srv():
    with ServerThread(tiny_app()) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


# --- the happy paths, with the openai client ---------------------------------------------------------------------

def test_models_and_health(srv, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    h = health(srv)
    assert h["status"] == "ok" and h["kv_blocks_total"] == 128
    assert srv.url.startswith("http://127.0.0.1:")


def test_completion_greedy_equals_offline_engine_streamed_or_not(client):
    prompt = "The quick brown fox"
    ref = offline([TOK.encode(prompt)], [SamplingParams(temperature=0, max_new_tokens=12)])[0]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == TOK.decode(ref, skip_special_tokens=True)
    n_ref = len(ref)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == n_ref
    assert r.choices[0].finish_reason == ("length" if n_ref == 12 else "stop")
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == n_ref and not chunks[-1].choices


def test_prompt_as_token_ids(client):
    ids = [5, 17, 99, 200, 31]
    ref = offline([ids], [SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)])[0]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == TOK.decode(ref, skip_special_tokens=True) and r.usage.completion_tokens == 8


def test_chat_streamed_and_not(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ids = TOK.encode(TOK.apply_chat_template(messages))
    ref = offline([ids], [SamplingParams(temperature=0, max_new_tokens=10)])[0]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == TOK.decode(ref, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.total_tokens == len(ids) + len(ref)
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == r.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert len({c.id for c in stream}) == 1


def test_stop_strings_cut_the_text_before_the_stop_streamed_or_not(client):
    prompt = [40, 41, 42, 43]
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) >= 12
    stop = full[6:9]                            # three characters from the middle: the output must end before them
    expect = full[:full.find(stop)]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\x00zz"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expect
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt="abc", max_tokens=16, temperature=2.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    a = sample(7)
    assert sample(7) == a
    assert len({a, sample(8), sample(9)}) > 1, "three seeds at temperature 2 gave one text: is the seed ignored?"


# --- errors ------------------------------------------------------------------------------------------------------

BAD = [
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, "temperature", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "n": 17}, "n", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "seed": -3}, "seed", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "logprobs": 6}, "logprobs", "invalid_parameter"),     # OpenAI's bound: 5
    ({"model": "tiny", "prompt": "hi", "echo": True}, "echo", "unsupported"),
    ({"model": "tiny"}, "prompt", "invalid_parameter"),
    ({"model": "tiny", "prompt": ""}, "prompt", "invalid_parameter"),
    ({"model": "tiny", "prompt": [1, 2, 999]}, "prompt", None),
    ({"model": "tiny", "prompt": "snow \u2603"}, "prompt", "invalid_parameter"),          # not in the vocabulary
    ({"model": "tiny", "prompt": "x" * 1024}, "prompt", "context_length_exceeded"),
    ({"model": "tiny", "prompt": "x" * 1000, "max_tokens": 100}, "max_tokens", "context_length_exceeded"),
    ({"model": "tiny", "messages": []}, "messages", "invalid_parameter"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, "messages", "invalid_parameter"),
    # the agent loop's messages: what is malformed is named
    ({"model": "tiny", "messages": [{"role": "tool", "content": "22 C"}]}, "messages.0.tool_call_id",
     "unsupported_parameter"),
    ({"model": "tiny", "messages": [{"role": "user", "content": None}]}, "messages.0.content", "unsupported_parameter"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls",
     "unsupported_parameter"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "invalid_parameter"),
    # malformed tool fields are 400s, never 500s
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "get_weather"}}], "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice",
     "invalid_parameter"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "f"}}], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_parameter"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"const": float("nan")}}}}, "response_format",
     "invalid_parameter"),
    # OpenAI fields tinyserve does not honour are refused, never silently dropped
    ({"model": "tiny", "prompt": "hi", "best_of": 3}, "best_of", "unsupported_parameter"),
    ({"model": "tiny", "prompt": "hi", "suffix": "end"}, "suffix", "unsupported_parameter"),
    ({"model": "tiny", "prompt": "hi", "logit_bias": {"5": 10}}, "logit_bias", "unsupported_parameter"),
    ({"model": "tiny", "prompt": "hi", "frequency_penalty": 0.5}, "frequency_penalty", "unsupported_parameter"),
    ({"model": "tiny", "prompt": "hi", "presence_penalty": -1}, "presence_penalty", "unsupported_parameter"),
    ({"model": "tiny", "prompt": "hi", "max_token": 5}, "max_token", "unsupported_parameter"),        # a typo
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs",
     "unsupported_parameter"),                                   # OpenAI: top_logprobs needs logprobs: true
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "invalid_parameter"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"},
     "reasoning_effort", "unsupported_parameter"),
    # no type coercion: a value of the wrong JSON type is refused
    ({"model": "tiny", "prompt": "hi", "stream": "yes"}, "stream", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": True}, "max_tokens", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "temperature": "0.5"}, "temperature", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "n": 2.0}, "n", "invalid_parameter"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs",
     "invalid_parameter"),
    # sampling-parameter errors name their field
    ({"model": "tiny", "prompt": "hi", "repetition_penalty": 1000}, "repetition_penalty", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "top_k": -1}, "top_k", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "stop": ""}, "stop", "invalid_parameter"),
]


@pytest.mark.parametrize("body,param,code", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_400_with_an_openai_error_body(srv, body, param, code):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(srv.url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"] and err["param"] == param and err["code"] == code, err


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2", "{\"model\": \"tiny\", \"prompt\": \"\xff\"}".encode("latin-1")])
def test_malformed_json_gets_400(srv, raw):
    r = httpx.post(srv.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_the_openai_client_raises_on_errors_and_unknown_routes_answer_in_the_same_shape(srv, client):
    with pytest.raises(openai.NotFoundError, match="not served here"):      # OpenAI and vLLM answer 404 too
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "gpt-4", "messages": [
        {"role": "user", "content": "hi"}]}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y" * 2000}])
    r = httpx.get(srv.url + "/v1/engines", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"]
    assert health(srv)["errors"] == 0, "a refused request must never reach the engine as an error"


def test_queue_full_answers_429():
    """max_running=1, max_waiting=1: one request runs, one waits, the third is turned away at once."""
    with ServerThread(tiny_app(max_running=1, max_waiting=1, engine_class=SlowEngine)) as s:
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 900, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=30) as c1, httpx.Client(timeout=30) as c2:
            with c1.stream("POST", s.url + "/v1/completions", json=body) as r1:
                lines1 = r1.iter_lines()    # keep the iterator: a dropped one closes the connection (= hang up)
                next(lines1)                                            # the first request is running
                with c2.stream("POST", s.url + "/v1/completions", json=body) as r2:
                    assert r2.status_code == 200                        # ... the second one is accepted, waiting
                    assert health(s)["queued"] == 1
                    t0 = time.perf_counter()
                    r3 = httpx.post(s.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
                    assert r3.status_code == 429 and time.perf_counter() - t0 < 5
                    assert r3.headers["retry-after"] == "1"                 # when to try again
                    err = r3.json()["error"]
                    assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
                    with pytest.raises(openai.RateLimitError):
                        openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0).completions.create(
                            model="tiny", prompt="a", max_tokens=2)
        assert_no_leak(s)      # both streams were closed early: both aborted, their blocks back
        assert health(s)["aborted"] == 2
        metrics = httpx.get(s.url + "/metrics").text
        assert 'tinyserve_requests_rejected_total{reason="queue_full"} 2.0' in metrics


def test_a_request_that_fails_in_the_engine_gets_an_error_and_the_others_carry_on(srv, client, monkeypatch):
    """One request's sampling raises inside step() (Engine: finish_reason "error"): its client is told, in the
    stream or with a 500, and a request running beside it is not disturbed."""
    import tinyserve.sampling as sampling_module
    real_sample = sampling_module.sample

    def sample(logits, params, rng, seen=()):
        if params.temperature == 1.25:
            raise FloatingPointError("injected failure")
        return real_sample(logits, params, rng, seen=seen)

    monkeypatch.setattr(sampling_module, "sample", sample)
    before = wait_idle(srv)
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "boom", "max_tokens": 5,
                                                      "temperature": 1.25}, timeout=30)
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "boom", "max_tokens": 5, "temperature": 1.25,
                            "stream": True}) as resp:
        events = list(parse_sse(resp.iter_lines()))
    assert "injected failure" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    ok = client.completions.create(model="tiny", prompt="fine", max_tokens=5, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")
    after = wait_idle(srv)
    assert after["errors"] == before["errors"] + 2
    assert_no_leak(srv)


# --- OpenAI fields honoured: developer role, logprobs, n ------------------------------------------------------

def test_the_developer_role_is_the_system_role(client):
    def chat(role):
        return client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
            {"role": role, "content": "be brief"}, {"role": "user", "content": "hello"}])
    dev, system = chat("developer"), chat("system")
    assert dev.choices[0].message.content == system.choices[0].message.content
    assert dev.usage.prompt_tokens == system.usage.prompt_tokens


def _log_softmax(logits):
    x = logits.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_completion_logprobs_are_the_models_log_softmax(client):
    ids = [5, 17, 99, 200, 31]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    ref = _log_softmax(ts.naive.forward(ts.tiny_model(seed=0), ids)[-1])            # the first token's distribution
    first = int(np.argmax(ref))
    assert lp.tokens[0] == chr(first) and lp.token_logprobs[0] == pytest.approx(ref[first], abs=1e-4)
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(token_lp)     # greedy: the best one
        assert list(top.values()) == sorted(top.values(), reverse=True) and token in top


def test_chat_logprobs_streamed_and_not(client):
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) and
               bytes(c.bytes).decode() == c.token for c in content)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None                                      # only when asked
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    # (the second run finds the prompt in the prefix cache: other batch shapes, float sums in another order)
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, pytest.approx(c.logprob, abs=1e-4))
                                                        for c in content]
    assert all(c.top_logprobs == [] for c in streamed)                            # top_logprobs not asked: none


def test_logprobs_with_speculative_decoding_are_refused():
    engine = Engine(ts.tiny_model(seed=0), num_blocks=64, tokenizer=TOK, speculative="ngram")
    with ServerThread(create_app(engine, TOK, "tiny")) as s:
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "abc", "logprobs": 1}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        assert httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 3},
                          timeout=30).status_code == 200
    with pytest.raises(ValueError, match="speculative"):
        engine.add_request([5, 6], SamplingParams(logprobs=0))


def _metric(srv, name: str) -> float:
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_n_choices_share_the_prompts_kv_blocks_through_the_prefix_cache(srv, client):
    prompt = "".join(chr(40 + i % 80) for i in range(64))           # 64 tokens: 4 blocks of 16
    before = wait_idle(srv)
    extra, hits = _metric(srv, "tinyserve_extra_samples_total"), \
        _metric(srv, "tinyserve_extra_sample_prefix_hit_tokens_total")
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=11, n=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == 64 and len({c.text for c in r.choices}) > 1     # seeds 11, 12, 13
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=11, n=3,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]           # reproducible
    assert r.choices[0].text == client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=11, extra_body={"ignore_eos": True}
    ).choices[0].text                                                               # choice 0 is the n = 1 answer
    after = wait_idle(srv)
    assert after["submitted"] == before["submitted"] + 7
    assert _metric(srv, "tinyserve_extra_samples_total") == extra + 4
    # each extra choice found at least the prompt's first 3 full blocks cached (the last one holds the token
    # that must run again to give logits)
    assert _metric(srv, "tinyserve_extra_sample_prefix_hit_tokens_total") >= hits + 4 * 48
    assert_no_leak(srv)


def test_n_choices_streamed_with_the_openai_client(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}],
                                                 max_tokens=6, temperature=0, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    texts, reasons = {0: "", 1: ""}, {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert texts[0] == texts[1] and set(reasons) == {0, 1}                          # greedy: the same answer twice
    assert chunks[-1].usage.completion_tokens == 2 * len(texts[0]) or reasons[0] == "stop"


def test_n_choices_of_a_client_that_hangs_up_are_all_aborted():
    with ServerThread(tiny_app(engine_class=SlowEngine)) as s:
        before = wait_idle(s)
        body = {"model": "tiny", "prompt": "z" * 40, "max_tokens": 400, "n": 3, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert sum(1 for line, _ in zip(lines, range(4)) if line.startswith("data:")) >= 2
        after = wait_idle(s)
        assert after["aborted"] == before["aborted"] + 3 and after["completed"] == before["completed"]
        assert_no_leak(s)


# --- the event loop stays free: tokenizing runs in a worker thread ------------------------------------------------

class ThreadRecordingTokenizer(CharTokenizer):
    """The tiny tokenizer, noting which thread encodes and renders the chat template."""
    def __init__(self):
        super().__init__()
        self.threads = []

    def encode(self, text):
        self.threads.append(threading.current_thread().name)
        return super().encode(text)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        self.threads.append(threading.current_thread().name)
        return super().apply_chat_template(messages, add_generation_prompt)


def test_prompts_are_tokenized_off_the_event_loop():
    tok = ThreadRecordingTokenizer()
    with ServerThread(tiny_app(tokenizer=tok)) as s:
        assert httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 2},
                          timeout=30).status_code == 200
        assert httpx.post(s.url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": "abc"}]}, timeout=30).status_code == 200
    assert len(tok.threads) == 3 and "tinyserve-http" not in tok.threads, tok.threads   # uvicorn's loop thread


def test_a_prompt_too_long_for_any_tokenization_is_refused_without_tokenizing_it():
    """1 character per token at most (the tiny tokenizer): 1 MB cannot fit a 1024-token context, whatever it says."""
    tok = ThreadRecordingTokenizer()
    with ServerThread(tiny_app(tokenizer=tok)) as s:
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 1_000_000}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == "prompt"
    assert tok.threads == []


# --- the front door: body size, timeouts, connection cap, API key, OpenAPI -----------------------------------------

def _raw(url: str, timeout: float = 10.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes `sock` (reading and dropping what it sends); fails if it stays open."""
    sock.settimeout(seconds)
    t0 = time.perf_counter()
    try:
        while sock.recv(65536):
            pass
    except socket.timeout:
        raise AssertionError(f"the server kept the connection open for {seconds} s") from None
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return time.perf_counter() - t0


def test_a_body_over_the_limit_gets_413_before_it_is_read():
    with ServerThread(tiny_app(limits=HttpLimits(max_body_size=2000))) as s:
        ok = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 500, "max_tokens": 2},
                        timeout=30)
        assert ok.status_code == 200
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 3000}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
        # no Content-Length (chunked): refused as soon as the body outgrows the limit
        chunked = httpx.post(s.url + "/v1/completions", content=iter([b'{"model": "tiny", "prompt": "', b"y" * 3000,
                                                                      b'"}']), timeout=30)
        assert chunked.status_code == 413
        # a Content-Length of 100 MB is answered at once, without waiting for (or reading) the body
        sock = _raw(s.url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n{")
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 413 ")
        _closed_within(sock, 10)                               # and the connection is closed: no 100 MB to drain
        metrics = httpx.get(s.url + "/metrics").text
        assert 'tinyserve_requests_rejected_total{reason="body_too_large"} 3.0' in metrics


SHORT = HttpLimits(header_timeout=0.5, body_timeout=0.5, keep_alive_timeout=0.5)


@pytest.fixture(scope="module")
def short_srv():
    with ServerThread(tiny_app(limits=SHORT)) as s:
        yield s


def test_an_idle_connection_is_closed_after_the_header_timeout(short_srv):
    _closed_within(_raw(short_srv.url), 10)


def test_a_half_sent_header_is_closed_after_the_header_timeout(short_srv):
    sock = _raw(short_srv.url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    _closed_within(sock, 10)


def test_a_body_shorter_than_its_content_length_is_closed_after_the_body_timeout(short_srv):
    before = wait_idle(short_srv)
    sock = _raw(short_srv.url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\": \"tiny\"")
    _closed_within(sock, 10)
    assert wait_idle(short_srv)["submitted"] == before["submitted"]


def test_a_slow_header_is_cut_even_if_bytes_keep_coming(short_srv):
    """The header timeout counts from the first byte, not from the last: one byte every 0.2 s cannot hold a
    connection open for ever."""
    sock = _raw(short_srv.url)
    sock.setblocking(False)                              # recv answers at once: data, b"" (closed) or EAGAIN
    t0, closed = time.perf_counter(), False
    for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:      # 28 s at this pace
        try:
            sock.sendall(bytes([b]))
            time.sleep(0.2)
            closed = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:                          # nothing to read: still open
            pass
        except OSError:                                  # reset: closed
            closed = True
        if closed or time.perf_counter() - t0 > 10:
            break
    sock.close()
    assert closed, "a header dripping in byte by byte held the connection for 10 s"


def test_an_idle_kept_alive_connection_is_closed_and_a_prompt_client_is_served(short_srv):
    sock = _raw(short_srv.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    _closed_within(sock, 3)                               # then idle: closed after the keep-alive timeout
    with httpx.Client(timeout=10) as c:                   # a client that sends its requests in time is served,
        for _ in range(3):                                # also on one kept-alive connection
            assert c.get(short_srv.url + "/health").status_code == 200
            time.sleep(0.1)


def test_connections_beyond_the_cap_get_503():
    with ServerThread(tiny_app(limits=HttpLimits(max_connections=3))) as s:
        held = [_raw(s.url) for _ in range(3)]            # three idle connections take the three places
        time.sleep(0.2)
        try:
            r = httpx.get(s.url + "/health", timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections", r.text
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.2)
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def keyed_srv():
    with ServerThread(tiny_app(limits=HttpLimits(api_key="sk-tiny-secret"))) as s:
        yield s


def test_the_api_key_is_required_on_v1_with_the_openai_client(keyed_srv):
    def client(key):
        return openai.OpenAI(base_url=keyed_srv.url + "/v1", api_key=key, max_retries=0, timeout=30)
    r = client("sk-tiny-secret").completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert r.choices[0].text is not None
    for wrong in ("sk-tiny-secreT", "sk-tiny-secret-and-more", "x"):
        with pytest.raises(openai.AuthenticationError) as e:
            client(wrong).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client("sk-tiny-secret").with_options(default_headers={"Authorization": ""}).models.list()
    r = httpx.get(keyed_srv.url + "/v1/models", headers={"Authorization": "Basic sk-tiny-secret"})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(keyed_srv.url + "/health").status_code == 200           # liveness stays open
    assert httpx.get(keyed_srv.url + "/v1/models", headers={"Authorization": "Bearer sk-tiny-secret"}).is_success


def test_the_api_key_comes_from_the_option_or_the_environment(monkeypatch):
    from tinyserve.http_guard import limits_from_args
    monkeypatch.setenv("TINYSERVE_API_KEY", "from-env")
    assert limits_from_args(_serve_args()).api_key == "from-env"
    assert limits_from_args(_serve_args("--api-key", "from-flag")).api_key == "from-flag"
    monkeypatch.delenv("TINYSERVE_API_KEY")
    assert limits_from_args(_serve_args()).api_key is None
    with pytest.raises(ValueError, match="empty"):
        HttpLimits(api_key=" ")


def test_the_openapi_schema_documents_what_the_server_answers(srv):
    schema = httpx.get(srv.url + "/openapi.json", timeout=10).json()
    assert "422" not in json.dumps(schema["paths"])
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "413", "429"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/Error"
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain; version=0.0.4"]
    assert httpx.get(srv.url + "/metrics").headers["content-type"].startswith("text/plain")


# --- disconnects ---------------------------------------------------------------------------------------------

def test_a_client_that_disconnects_mid_stream_is_aborted_and_its_blocks_freed(srv):
    before = wait_idle(srv)
    body = {"model": "tiny", "prompt": "abcdefgh" * 40, "max_tokens": 600, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", srv.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6))]
            assert any(line.startswith("data:") for line in got)
            held = health(srv)["kv_blocks_used"]
            assert held >= 320 // 16, "the running request should hold its prompt's blocks"
        # the connection is closed here, long before 600 tokens
    after = wait_idle(srv)
    assert after["aborted"] == before["aborted"] + 1 and after["completed"] == before["completed"]
    assert_no_leak(srv)
    assert 'tinyserve_requests_total{finish_reason="abort"}' in httpx.get(srv.url + "/metrics").text


def test_a_non_streaming_client_that_gives_up_is_aborted_too():
    # a slow engine (20 ms a step): the tiny model at full speed could finish 200 tokens before the client's 0.3 s
    # are up, and the request would count as completed (this test was flaky that way)
    with ServerThread(tiny_app(engine_class=SlowEngine)) as s:
        before = wait_idle(s)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "q" * 300, "max_tokens": 200,
                                                        "temperature": 0, "ignore_eos": True}, timeout=0.3)
        after = wait_idle(s)
        assert after["aborted"] == before["aborted"] + 1 and after["completed"] == before["completed"]
        assert_no_leak(s)


# --- load -------------------------------------------------------------------------------------------------------

def test_load_many_concurrent_streams_nothing_lost_greedy_exact_no_leak():
    """48 concurrent streaming clients, 240 requests of mixed lengths (4..200 prompt, 1..64 output tokens), every
    8th one hanging up after 2 chunks. A small pool (128 blocks for up to 32 running requests) forces preemption."""
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(240):
        prompt = [int(t) for t in rng.integers(3, 256, int(rng.integers(4, 201)))]
        n_out = int(rng.integers(1, 65))
        cut = 2 if i % 8 == 7 and n_out >= 16 else None
        reqs.append(ClientRequest(prompt, n_out, disconnect_after=cut))
    refs = offline([r.prompt for r in reqs],
                   [SamplingParams(temperature=0, max_new_tokens=r.max_tokens, ignore_eos=True) for r in reqs])
    with ServerThread(tiny_app(num_blocks=128, max_running=32, max_waiting=256)) as s:
        report = drive(s.url, "tiny", reqs, concurrency=48)
        h = wait_idle(s)
        cancelled = [r for r in report.results if r.cancelled]
        assert len(cancelled) >= 10
        for req, res, ref in zip(reqs, report.results, refs):
            assert res.status == 200 and res.error is None, (res.status, res.error)
            if not res.cancelled:
                assert res.finish_reason == "length" and res.completion_tokens == req.max_tokens
                assert res.text == TOK.decode(ref, skip_special_tokens=True), "greedy output differs from offline"
        # every request the server took either completed or was cancelled; the cancelled ones are the hang-ups
        assert h["submitted"] == 240 and h["completed"] + h["aborted"] == 240 and h["errors"] == 0
        assert 1 <= h["aborted"] <= len(cancelled)
        assert_no_leak(s)
        metrics = httpx.get(s.url + "/metrics").text
        assert "tinyserve_time_to_first_token_seconds_count 240.0" in metrics
        summary = report.summary()
        assert summary["completed"] == 240 - len(cancelled) and summary["errors"] == 0


def test_bench_drives_a_running_server(srv, capsys):
    from tinyserve.__main__ import main
    before = wait_idle(srv)
    assert main(["bench", "--server", srv.url, "--requests", "9", "--prompt-len", "4:40", "--output-len", "4:12",
                 "--concurrency", "3", "--hangup-every", "3"]) == 0
    out = capsys.readouterr().out
    assert "6 completed, 3 cancelled by their client, 0 rejected (429), 0 errors" in out, out
    assert "TTFT p50" in out and "0 KV blocks held by requests" in out
    assert wait_idle(srv)["submitted"] == before["submitted"] + 9


# --- the process: CLI, SIGTERM -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*args: str):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"}
    # the NumPy reference: these tests are about draining, and need no kernels compiled
    proc = subprocess.Popen([sys.executable, "-m", "tinyserve", "serve", "--model", "tiny", "--quant", "none",
                             "--backend", "numpy", "--port", str(port), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.perf_counter() - t0 > 60:
            proc.kill()
            raise AssertionError(f"the server did not come up: {proc.stderr.read()}")
        time.sleep(0.1)


def _sigterm_mid_stream(proc, url: str, max_tokens: int) -> list:
    body = {"model": "tiny", "prompt": "drain me", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    break
            proc.send_signal(signal.SIGTERM)               # mid-stream
            for event in parse_sse(lines):
                events.append(event)
    except httpx.RemoteProtocolError:                      # the server cut the stream (drain timeout)
        pass
    # uvicorn re-raises the signal once it has shut down cleanly: the process ends "killed by SIGTERM"
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
    return events


def test_serve_subcommand_drains_streams_in_flight_on_sigterm():
    proc, url = _start()
    try:
        events = _sigterm_mid_stream(proc, url, 300)
        assert events[-1] == "[DONE]", "the stream in flight was cut instead of drained"
        assert events[-2]["usage"]["completion_tokens"] == 300
        err = proc.stderr.read()
        assert "1 completed, 0 cancelled" in err and "0 KV blocks still held" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serving_beyond_loopback_without_a_key_warns():
    proc, url = _start("--host", "0.0.0.0", "--timeout-header", "3")
    proc.terminate()
    proc.wait(timeout=60)
    err = proc.stderr.read()
    assert "WARNING: serving on 0.0.0.0 without an API key" in err, err
    proc, url = _start("--host", "0.0.0.0", "--api-key", "k")
    proc.terminate()
    proc.wait(timeout=60)
    assert "WARNING" not in proc.stderr.read()


def test_sigterm_cancels_what_does_not_finish_within_the_drain_timeout():
    # 1000 tokens of the tiny model take ~0.25 s on a 2-core Zen 5 (in process): a 0.2 s drain was a race it once lost
    proc, url = _start("--drain-timeout", "0.05")
    try:
        events = _sigterm_mid_stream(proc, url, 1000)
        assert "[DONE]" not in events and len(events) < 1000
        err = proc.stderr.read()
        assert "0 completed, 1 cancelled" in err and "0 KV blocks still held" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- the real model ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_srv(smol, smol_tok):
    engine = Engine(smol, num_blocks=256, block_size=16, max_batch_tokens=256, tokenizer=smol_tok,
                    prefix_caching=True)
    with ServerThread(create_app(engine, smol_tok, "smollm2-135m-instruct")) as s:
        yield s


@pytest.mark.real
def test_text_stream_never_emits_half_a_character(smol_tok):
    text = "Caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f389 done"
    ids = smol_tok.encode(text)
    stream = TextStream(smol_tok, stop=("\U0001f389",))
    pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text[:text.index("\U0001f389")] and stream.stopped


@pytest.mark.real
def test_real_model_chat_with_the_openai_client_matches_offline_greedy(smol, smol_tok, smol_srv):
    client = openai.OpenAI(base_url=smol_srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smol_tok.encode_chat(messages)
    ref = Engine(smol, num_blocks=64, tokenizer=smol_tok).generate([ids], SamplingParams(temperature=0,
                                                                                        max_new_tokens=16))[0]
    expect = smol_tok.decode(ref, skip_special_tokens=True)
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=16,
                                       temperature=0)
    assert r.choices[0].message.content == expect and "Paris" in expect
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2-135m-instruct", messages=messages, max_tokens=16, temperature=0, stream=True))
    assert streamed == expect
    assert_no_leak(smol_srv)


@pytest.mark.real
@pytest.mark.slow
def test_real_model_load_run(smol, smol_srv):
    """A small load run on SmolLM2: 8 concurrent streams, 24 requests, 2 of them hanging up; greedy exact."""
    rng = np.random.default_rng(1)
    reqs = [ClientRequest([int(t) for t in rng.integers(3, smol.config.vocab_size, int(rng.integers(8, 65)))],
                          int(rng.integers(4, 17)), disconnect_after=2 if i in (5, 17) else None) for i in range(24)]
    refs = Engine(smol, num_blocks=256).generate(
        [r.prompt for r in reqs], [SamplingParams(temperature=0, max_new_tokens=r.max_tokens, ignore_eos=True)
                                   for r in reqs])
    tok = ts.load_tokenizer()
    report = drive(smol_srv.url, "smollm2-135m-instruct", reqs, concurrency=8)
    for req, res, ref in zip(reqs, report.results, refs):
        assert res.status == 200 and res.error is None
        if not res.cancelled:
            assert res.completion_tokens == req.max_tokens
            assert res.text == tok.decode(ref, skip_special_tokens=True)
    assert_no_leak(smol_srv)
    print(json.dumps(report.summary()))


# --- which path serves: the same default as generate, the reference one flag away ---------------------------------

def _serve_args(*extra: str):
    from tinyserve.__main__ import build_parser
    return build_parser().parse_args(["serve", "--model", "tiny", "--num-blocks", "64", *extra])


def test_serve_defaults_to_generates_fast_path_and_says_so(monkeypatch, tmp_path):
    from tinyserve import jit
    from tinyserve.backend import set_backend
    from tinyserve.server import build
    monkeypatch.setattr(jit, "cache_dir", lambda: tmp_path)       # cold: no stamp
    monkeypatch.setattr(jit, "warm_up", lambda quant, workload="kv", log=None: 0.0)   # the kernels load when used
    lines = []
    app, name = build(_serve_args("--compile", "wait"), log=lines.append)
    assert any("compiling the int8 kernels" in line for line in lines)
    assert (app.state.engine.model.quant, app.state.engine.model.backend, app.state.engine.backend) == \
        ("int8", "numba", "numba")
    with ServerThread(app) as s:
        h = health(s)
        assert h["path"].startswith("int8 weights (W8A32), numba backend, kernels: ") and \
            h["kernels"] == "compiled at start"                    # (and which instruction set: kernels/isa.py)
        assert httpx.get(s.url + "/v1/models").json()["data"][0]["path"] == h["path"]
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True}, timeout=120).json()
    ref = Engine(set_backend(ts.tiny_model(seed=0), "int8", "numba"), num_blocks=64).generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))[0]
    assert r["choices"][0]["text"] == TOK.decode(ref)


def test_serve_runs_the_reference_one_flag_away():
    from tinyserve.server import build
    app, _ = build(_serve_args("--quant", "none", "--backend", "numpy"))
    with ServerThread(app) as s:
        h = health(s)
    assert h["path"] == "float32, numpy backend" and h["kernels"] == "none needed (NumPy)"


def test_serve_moves_to_the_fast_path_once_the_background_compile_is_done(monkeypatch, tmp_path):
    """Cold start: the server answers at once on the NumPy stand-in; when the (fake, 1 s) compile is done it swaps
    the engine's model at a step boundary, and says so on /health."""
    from tinyserve import jit
    from tinyserve.server import build
    stamp = tmp_path / "tinyserve-warm-int8-engine.json"
    code = (f"import time, pathlib; time.sleep(1.0); "
            f"pathlib.Path({str(stamp)!r}).write_text({json.dumps(json.dumps(jit.cache_key('int8', 'engine')))})")
    monkeypatch.setattr(jit, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(jit, "compile_argv", lambda quant, workload: [sys.executable, "-c", code])
    monkeypatch.setattr(jit, "warm_up", lambda quant, workload="kv", log=None: 0.0)
    app, _ = build(_serve_args(), log=lambda line: None)
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with ServerThread(app) as s:
        h = health(s)
        assert h["path"] == "float32, numpy backend" and h["kernels"].startswith("compiling in the background")
        first = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        t0 = time.perf_counter()
        while not health(s)["path"].startswith("int8"):   # the swap happens after a step: keep the engine busy
            httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert time.perf_counter() - t0 < 60, health(s)
        h = health(s)
        assert h["kernels"].startswith("compiled in the background in") and app.state.engine.backend == "numba"
        again = httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    assert again == first          # the stand-in computes the int8 model: greedy gives the same answer
