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
             engine_class=Engine):
    engine = engine_class(ts.tiny_model(seed=0), num_blocks=num_blocks, block_size=16, max_batch_tokens=max_batch_tokens,
                    max_running=max_running, tokenizer=TOK, prefix_caching=prefix_caching)
    return create_app(engine, TOK, "tiny", max_waiting=max_waiting)


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
    ({"model": "gpt-4", "prompt": "hi"}, "model", "model_not_found"),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, "temperature", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "n": 2}, "n", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "seed": -3}, "seed", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_parameter"),
    ({"model": "tiny", "prompt": "hi", "logprobs": 3}, "logprobs", "unsupported"),
    ({"model": "tiny", "prompt": "hi", "echo": True}, "echo", "unsupported"),
    ({"model": "tiny"}, "prompt", "invalid_parameter"),
    ({"model": "tiny", "prompt": ""}, "prompt", "invalid_parameter"),
    ({"model": "tiny", "prompt": [1, 2, 999]}, "prompt", None),
    ({"model": "tiny", "prompt": "snow \u2603"}, "prompt", "invalid_parameter"),          # not in the vocabulary
    ({"model": "tiny", "prompt": "x" * 1024}, "prompt", "context_length_exceeded"),
    ({"model": "tiny", "prompt": "x" * 1000, "max_tokens": 100}, "max_tokens", "context_length_exceeded"),
    ({"model": "tiny", "messages": []}, "messages", "invalid_parameter"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, "messages", "invalid_parameter"),
]


@pytest.mark.parametrize("body,param,code", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_400_with_an_openai_error_body(srv, body, param, code):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(srv.url + path, json=body, timeout=10)
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
    with pytest.raises(openai.BadRequestError, match="not served here"):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
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
    import tinyserve.engine as engine_module
    real_sample = engine_module.sample

    def sample(logits, params, rng, seen=()):
        if params.temperature == 1.25:
            raise FloatingPointError("injected failure")
        return real_sample(logits, params, rng, seen=seen)

    monkeypatch.setattr(engine_module, "sample", sample)
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
    from tinyserve.quant import set_backend
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
