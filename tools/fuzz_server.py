"""Fuzz the OpenAI-compatible server: no request body may get a response >= 500.

    .venv/bin/python tools/fuzz_server.py [--schemathesis /work/venvs/fuzz/bin/schemathesis] [--max-time 240]

Starts `tinyserve serve --model tiny` on 127.0.0.1 (a free port; nothing else is contacted), then
  1. sends hand-made bodies: every field of both endpoints given values of every JSON type, nested deep, huge,
     NaN, and the structured-output fields (schemas, tools, tool_choice, the agent loop's messages) malformed in
     the ways a client gets them wrong;
  2. runs schemathesis (installed in a venv of its own: `python3 -m venv /work/venvs/fuzz && /work/venvs/fuzz/bin/pip
     install schemathesis`) on the server's own OpenAPI document with the not_a_server_error check, bounded in
     examples and time.
Prints the status counts and exits 1 if any response was >= 500. docs/serving.md keeps the last result.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent

VALUES = [None, True, False, 0, -1, 1, 2**63, -2**63, 1e308, -0.0, 0.5, "", "x", "tiny", "\u0000", "é" * 50,
          [], [1], ["a"], {}, {"a": 1}, [[[[[]]]]], float("nan"), float("inf")]
FIELDS_COMMON = ["model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "n",
                 "top_k", "min_p", "repetition_penalty", "ignore_eos", "response_format", "logprobs",
                 "best_of", "logit_bias", "user", "metadata", "unknown_field"]
FIELDS_CHAT = ["messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"]
FIELDS_COMPLETION = ["prompt", "echo", "suffix"]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def nested(depth: int, leaf=1):
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


def deep_schema(depth: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}}
    return s


def handmade(rng: random.Random) -> list[tuple[str, bytes]]:
    """(path, body bytes) pairs."""
    base_chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    base_comp = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    out = []
    for base, path, fields in ((base_chat, "/v1/chat/completions", FIELDS_COMMON + FIELDS_CHAT),
                               (base_comp, "/v1/completions", FIELDS_COMMON + FIELDS_COMPLETION)):
        for f in fields:
            for v in VALUES:
                out.append((path, json.dumps({**base, f: v}).encode()))
    specials = [
        {**base_chat, "tools": [TOOL], "tool_choice": {"type": "function", "function": "get_weather"}},
        {**base_chat, "tools": [TOOL], "tool_choice": {"function": {"name": 3}}},
        {**base_chat, "tools": [TOOL], "tool_choice": ["auto"]},
        {**base_chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": deep_schema(400)}}]},
        {**base_chat, "tools": [TOOL] * 200},
        {**base_chat, "tools": [{"type": "function"}]},
        {**base_chat, "tools": [TOOL], "stream": True},
        {**base_chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep_schema(400)}}},
        {**base_chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": 1e999}}}},
        {**base_chat, "response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}},
        {**base_chat, "response_format": {"type": "json_schema", "json_schema": {"schema": {
            "type": "string", "pattern": "(" * 500}}}},
        {**base_chat, "response_format": {"type": "json_schema", "json_schema": {"schema": {
            "type": "integer", "minimum": 10, "maximum": 1}}}},
        {**base_chat, "messages": [{"role": "tool", "content": "x"}]},
        {**base_chat, "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": 1}]}]},
        {**base_chat, "messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}], "tools": [TOOL]},
        {**base_chat, "messages": nested(500)},
        {**base_chat, "messages": [{"role": "user", "content": "x"}] * 20_000},
    ]
    out += [("/v1/chat/completions", json.dumps(b, allow_nan=True).encode()) for b in specials]
    for _ in range(200):                           # random bodies: random fields with random values
        path, fields = rng.choice([("/v1/chat/completions", FIELDS_COMMON + FIELDS_CHAT),
                                   ("/v1/completions", FIELDS_COMMON + FIELDS_COMPLETION)])
        body = {f: rng.choice(VALUES) for f in rng.sample(fields, rng.randint(1, 6))}
        out.append((path, json.dumps(body).encode()))
    deep = b"[" * 100_000 + b"]" * 100_000           # past Python's recursion limit, written by hand
    raw = [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"model": "tiny", "prompt": "\\ud800"}', b"[" * 100_000,
           b'{"model": "tiny", "prompt": "hi", "metadata": ' + deep + b"}",
           b'{"model": "tiny", "messages": ' + deep + b"}",
           b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "response_format": ' + deep + b"}"]
    out += [("/v1/completions", r) for r in raw]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemathesis", default="/work/venvs/fuzz/bin/schemathesis")
    ap.add_argument("--max-time", type=int, default=240, help="seconds for the schemathesis run")
    ap.add_argument("--max-examples", type=int, default=200, help="schemathesis examples per operation")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "tinyserve", "serve", "--model", "tiny", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit("the server did not start")
        counts: collections.Counter = collections.Counter()
        bad = []
        with httpx.Client(timeout=60) as c:
            for path, body in handmade(random.Random(0)):
                try:
                    r = c.post(url + path, content=body, headers={"content-type": "application/json"})
                except httpx.HTTPError as e:      # no answer at all is as bad as a 5xx
                    counts[type(e).__name__] += 1
                    bad.append((path, body[:200], type(e).__name__, ""))
                    continue
                counts[r.status_code] += 1
                if r.status_code >= 500:
                    bad.append((path, body[:200], r.status_code, r.text[:200]))
        print(f"hand-made bodies: {sum(counts.values())} requests, status counts "
              f"{dict(sorted(counts.items(), key=str))}", flush=True)
        for b in bad[:10]:
            print("  >= 500:", b)
        st_failed = 0
        if Path(args.schemathesis).exists():
            cmd = [args.schemathesis, "run", f"{url}/openapi.json", "--checks", "not_a_server_error",
                   "--max-examples", str(args.max_examples), "--max-time", str(args.max_time), "--seed", "1",
                   "--workers", "1", "--request-timeout", "60", "--no-color"]
            print("$", " ".join(cmd), flush=True)
            st = subprocess.run(cmd, capture_output=True, text=True)
            tail = "\n".join(st.stdout.strip().splitlines()[-25:])
            print(tail)
            st_failed = st.returncode
        else:
            print(f"schemathesis not found at {args.schemathesis}: only the hand-made bodies ran")
        return 1 if bad or st_failed else 0
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
