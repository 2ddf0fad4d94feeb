"""Lesson 8: an OpenAI-compatible HTTP server on the continuous-batching Engine (`python -m tinyserve serve`).

    POST /v1/completions, /v1/chat/completions    streamed as server-sent events (stream=true) or one JSON body
    GET  /v1/models, /health, /metrics            the served model; liveness + pool state; Prometheus text format

FastAPI parses and validates requests and uvicorn speaks HTTP (the libraries vLLM and SGLang use for this); the
Engine runs in its own thread (engine_loop.py). Each request is a coroutine that has its prompt tokenized in a
worker thread, submits, and then only waits on its own queue of tokens, so a slow client or a long prompt never
blocks anyone else. The rules:

  - before a route runs, http_guard.py checks the API key (401) and the body size (413), and uvicorn the
    header and body timeouts and the connection cap (503),
  - a full waiting queue answers 429 at once, with Retry-After (bounded memory, and the client learns to back off),
  - malformed JSON, bad parameters, OpenAI fields tinyserve does not honour and prompts longer than the context
    answer 400 with an OpenAI-style body {"error": {"message", "type", "param", "code"}}, an unknown model 404;
    the body is parsed, the prompt tokenized and a structured-output grammar compiled in a worker thread,
  - n > 1 runs n requests; all but the first join once the first has its prompt computed, and reuse its KV blocks
    through the prefix cache,
  - a client that disconnects is aborted: its KV blocks return to the pool at the next step boundary,
  - SIGTERM stops accepting connections, lets the streams in flight finish (up to --drain-timeout), then cancels
    what is left and exits. Binds 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .backend import runs_on_kernels
from .cli_options import describe_backend
from .engine import Engine
from .engine_loop import Event, EngineLoop, Observer, Rejected, RequestHandle
from .http_guard import Guard, HttpLimits, is_loopback, limits_from_args
from .protocol import (FINISH_REASONS, ChatCompletionRequest, Choice, CompletionRequest, Logprobs, TextStream,
                       chat_chunk, chat_response, completion_chunk, completion_response, error_body, new_id, sse_event,
                       usage)
from .sampling import SamplingParams
from . import structured_api, tool_calls
from .constrained import SchemaError, grammars_for
from .structured_api import Structured, StructuredError, structured_output
from .tokenizer import prompt_ids
from .tokenizer import CharTokenizer  # noqa: F401  (the tests and --model tiny import it from here too)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0)


class Metrics(Observer):
    """Prometheus metrics, fed by the engine thread (prometheus_client is thread-safe). One registry per server,
    so several servers in one process (the tests) do not mix their numbers."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("tinyserve_time_to_first_token_seconds", "request arrival -> first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("tinyserve_inter_token_latency_seconds", "gap between two tokens of one request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("tinyserve_e2e_request_latency_seconds", "request arrival -> finished",
                             buckets=TTFT_BUCKETS, registry=r)
        self.step = Histogram("tinyserve_engine_step_seconds", "one engine step (schedule + forward + sample)",
                              buckets=ITL_BUCKETS, registry=r)
        self.waiting = Gauge("tinyserve_num_requests_waiting", "requests queued, not yet admitted", registry=r)
        self.running = Gauge("tinyserve_num_requests_running", "requests in the running batch", registry=r)
        self.blocks_used = Gauge("tinyserve_kv_blocks_used", "KV blocks held by requests", registry=r)
        self.blocks_cached = Gauge("tinyserve_kv_blocks_cached", "KV blocks in the prefix cache", registry=r)
        self.blocks_total = Gauge("tinyserve_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.hit_rate = Gauge("tinyserve_prefix_cache_hit_rate", "prompt tokens served from the prefix cache / "
                              "prompt tokens, over all finished requests", registry=r)
        self.requests = Counter("tinyserve_requests", "finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("tinyserve_requests_rejected", "requests answered 4xx/5xx before running",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("tinyserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("tinyserve_generation_tokens", "tokens generated", registry=r)
        self.hit_tokens = Counter("tinyserve_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache",
                                  registry=r)
        self.extra_samples = Counter("tinyserve_extra_samples", "choices beyond the first of n > 1 requests (each "
                                     "reuses the first's prompt KV blocks)", registry=r)
        self.extra_sample_hit_tokens = Counter("tinyserve_extra_sample_prefix_hit_tokens",
                                               "prompt tokens those extra choices took from the prefix cache",
                                               registry=r)
        self._hits = [0, 0]

    def on_token(self, handle: RequestHandle, now: float) -> None:
        if handle.last_token_time is None:        # the loop sets it after this call: this is the first token
            self.ttft.observe(now - handle.arrival)
        else:
            self.itl.observe(now - handle.last_token_time)
        self.generation_tokens.inc()

    def on_finish(self, handle: RequestHandle, reason: str, hit_tokens: int, prompt_tokens: int) -> None:
        if handle.after is not None:
            self.extra_sample_hit_tokens.inc(hit_tokens)
        self.e2e.observe(time.perf_counter() - handle.arrival)
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.hit_tokens.inc(hit_tokens)
        self._hits[0] += hit_tokens
        self._hits[1] += prompt_tokens
        self.hit_rate.set(self._hits[0] / self._hits[1] if self._hits[1] else 0.0)

    def on_step(self, engine: Engine, loop: EngineLoop) -> None:
        snap = loop.snapshot()
        if engine.stats:
            self.step.observe(engine.stats[-1].seconds)
        engine.stats.clear()                 # a server runs for days: keep the step stats from growing
        self.waiting.set(snap["waiting"])
        self.running.set(snap["running"])
        self.blocks_used.set(snap["kv_blocks_used"])
        self.blocks_cached.set(snap["kv_blocks_cached"])
        self.blocks_total.set(snap["kv_blocks_total"])


class FastPathSwitch(Observer):
    """Lesson 7's first run, served: while the kernels compile in a child process the engine runs the NumPy stand-in
    (jit.py); a watcher thread waits for the compile and loads the kernels, then the engine thread swaps the model
    after its next step (a step boundary: no forward in flight). Passes every hook on to `inner` (the metrics)."""

    def __init__(self, inner: Observer, kernels):
        self.inner, self.kernels = inner, kernels
        self.ready = threading.Event()
        self.status = "compiling in the background; serving on the NumPy path meanwhile"
        threading.Thread(target=self._watch, name="tinyserve-jit", daemon=True).start()

    def _watch(self) -> None:
        k = self.kernels
        if not k.bg.wait():
            self.status = f"the background compile failed (see {k.bg.log_path}); serving on the NumPy path"
            print(f"tinyserve: {self.status}", file=sys.stderr, flush=True)
            return
        k.load()                            # in this thread: the engine keeps stepping
        self.ready.set()

    def on_token(self, handle, now) -> None:
        self.inner.on_token(handle, now)

    def on_finish(self, handle, reason, hit_tokens, prompt_tokens) -> None:
        self.inner.on_finish(handle, reason, hit_tokens, prompt_tokens)

    def on_step(self, engine: Engine, loop: EngineLoop) -> None:
        self.inner.on_step(engine, loop)
        if self.ready.is_set() and self.kernels.switched_at is None:
            self.kernels.move(engine, loop.stats.steps)     # a step boundary: no forward in flight
            self.status = f"compiled in the background in {self.kernels.seconds:.1f} s (first run only)"
            print(f"tinyserve: the fast path's kernels are ready ({self.status}); now serving on "
                  f"{describe_backend(engine.model)}", file=sys.stderr, flush=True)


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


RETRY_AFTER_SECONDS = 1      # a 429's Retry-After: the queue moves by a step every few tens of milliseconds


class _LogprobsOf:
    """One choice's logprobs as they arrive: a streamed chunk's part, or the whole answer's."""

    def __init__(self, tokenizer):
        self.format = Logprobs(tokenizer)
        self.tokens: list[int] = []
        self.entries: list = []

    def add(self, ev: Event) -> None:
        self.tokens += ev.tokens
        self.entries += ev.logprobs or []

    def part(self, ev: Event, chat: bool) -> dict:
        self.add(ev)
        return (self.format.chat if chat else self.format.completion)(ev.tokens, ev.logprobs or [])

    def whole(self, chat: bool) -> dict:
        return (self.format.chat if chat else self.format.completion)(self.tokens, self.entries)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


@dataclass(slots=True)
class _Prepared:
    ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    n: int = 1
    structured: Structured = Structured()     # response_format / tools (structured_api.py)

    def sample_params(self, i: int) -> SamplingParams:
        """Choice i's parameters: a seeded request gives its choices seeds seed, seed + 1, ... (reproducible, yet
        not n copies of one sample)."""
        if i == 0 or self.params.seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=self.params.seed + i)


class OpenAIService:
    """What the routes share, and each step of a request's way through the server as a method of its own: the
    engine thread (`loop`), the tokenizer, the served name and context, the metrics. `create_app` wires these
    methods to URLs; a test can call `prepare` or `completion_ids` without HTTP."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, max_waiting: int = 64, kernels=None):
        if engine.tokenizer is None:
            engine.tokenizer = tokenizer     # the engine's stop checker decodes with it
        self.engine, self.tokenizer, self.model_name, self.kernels = engine, tokenizer, model_name, kernels
        self.metrics = Metrics()
        self.switch = FastPathSwitch(self.metrics, kernels) if kernels is not None and kernels.bg is not None else None
        self.loop = EngineLoop(engine, max_waiting=max_waiting, observer=self.switch or self.metrics)
        self.vocab_size = engine.config.vocab_size
        # the most positions one request may use: the model's window, and the pool (a request may not need more
        # blocks than the whole pool, or it could never run)
        self.max_context = min(engine.config.max_seq_len, engine.blocks.num_blocks * engine.block_size)
        # a prompt of more characters than this has more tokens than the context: refused without tokenizing it
        # (a real tokenizer takes seconds for megabytes, and the answer is known)
        per_token = getattr(tokenizer, "max_token_chars", None)
        self.max_prompt_chars = per_token() * self.max_context if per_token is not None else None
        self.created = int(time.time())

    def path(self) -> dict:
        """Which path answers now (lesson 7): the default is int8 on numba, as for generate and chat."""
        if self.switch is not None:
            status = self.switch.status
        elif self.kernels is not None:
            status = {"cache": "loaded from the on-disk cache", "compiled": "compiled at start"}[self.kernels.how]
        else:
            status = "none needed (NumPy)"
        return {"path": describe_backend(self.engine.model), "kernels": status}

    # --- from a request body to token ids and SamplingParams (BadRequest: 400) ---------------------------------
    def encode(self, text: str, param: str) -> list[int]:
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise BadRequest(f"the prompt has {len(text)} characters, more than this server's context of "
                             f"{self.max_context} tokens can hold", param=param, code="context_length_exceeded")
        try:
            return prompt_ids(self.tokenizer, text)     # with the BOS a Llama 3 or SentencePiece model wants
        except ValueError as e:
            raise BadRequest(str(e), param=param, code="invalid_parameter") from None

    def completion_ids(self, body: CompletionRequest) -> list[int]:
        """/v1/completions' prompt: one string, a list of one string, or token ids."""
        if body.echo:
            raise BadRequest("echo is not supported by tinyserve", param="echo", code="unsupported")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise BadRequest("one prompt per request (batch them as concurrent requests)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.encode(prompt, "prompt")
        ids = list(prompt)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        return ids

    def chat_ids(self, body: ChatCompletionRequest, structured: Structured) -> list[int]:
        """The prompt: the messages through the chat template. Tools reach it through the template when it knows
        tools (Tokenizer.template_supports_tools), else through tool_calls.py's generic system prompt; the agent
        loop's messages (assistant tool_calls, tool results) are rendered either way."""
        messages = [m.as_dict() for m in body.messages]
        tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
                 for n, p, d in structured.functions]
        extra = tool_calls.tools_prompt({n: p for n, p, _ in structured.functions},
                                        {n: d for n, _, d in structured.functions}, structured.mode,
                                        structured.parallel) if structured.tools_active else None
        try:
            if structured.tools_active and getattr(self.tokenizer, "template_supports_tools", False):
                # the template shows the tools its own way; the answer's form is still the grammar's
                for m in messages:
                    for c in m.get("tool_calls") or ():
                        c["function"]["arguments"] = tool_calls.arguments_value(c["function"]["arguments"])
                msgs = tool_calls.render_generic([], extra, False) + [
                    {k: v for k, v in m.items() if v is not None} for m in messages]
                text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tools=tools)
            else:
                plain = tool_calls.render_generic(messages, extra, structured.mode == structured_api.MODEL_CHOOSES)
                text = self.tokenizer.apply_chat_template(plain)
        except (TypeError, ValueError, KeyError, RecursionError) as e:
            raise BadRequest(f"messages: the chat template cannot render them: {e}", param="messages",
                             code="invalid_parameter") from None
        return self.encode(text, "messages")

    def structured(self, body) -> Structured:
        extra = body.model_extra or {}
        if isinstance(body, CompletionRequest) and extra.get("tools") is not None:
            raise BadRequest("tools are for /v1/chat/completions (the answer is a tool_calls message)", param="tools")
        try:
            return structured_output(extra.get("response_format"), extra.get("tools"), extra.get("tool_choice"),
                                     body.stream, extra.get("parallel_tool_calls"))
        except StructuredError as e:
            raise BadRequest(str(e), param=e.param, code="invalid_parameter") from None

    def compile_grammar(self, schema, param: str) -> None:
        """Compile the request's grammar here, in the worker thread that prepares it: off the event loop and off the
        engine thread, within the compile budget (constrained/schema.py) and with its first mask computed, so the
        engine thread finds it in the cache. Refused: a 400."""
        if not hasattr(self.tokenizer, "token_bytes"):
            return                           # the engine refuses it with its own reason
        try:
            grammars_for(self.tokenizer, self.vocab_size, self.engine.config.eos_token_ids).get(schema)
        except (SchemaError, RecursionError) as e:
            raise BadRequest(f"{param}: {e}", param=param, code="invalid_parameter") from None

    def prepare(self, body, prompt_ids: list[int], max_tokens: int | None,
                structured: Structured | None = None) -> _Prepared:
        """Check what the engine would refuse later, with an OpenAI-style reason now."""
        self.check_model(body)
        k = body.num_logprobs()
        if k is not None and self.engine.speculator is not None:
            raise BadRequest("logprobs are not reported with speculative decoding: this server runs it",
                             param="logprobs", code="unsupported")
        if body.n > self.loop.max_waiting:
            raise BadRequest(f"n = {body.n} is more than this server's waiting queue ({self.loop.max_waiting})",
                             param="n", code="invalid_parameter")
        n, max_context = len(prompt_ids), self.max_context
        if n == 0:
            raise BadRequest("the prompt is empty", param="prompt", code="invalid_parameter")
        if n >= max_context:
            raise BadRequest(f"the prompt has {n} tokens, but this server's context is {max_context} tokens "
                             f"(including the output)", param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = max_context - n          # OpenAI: no max_tokens means up to the end of the context
        if n + max_tokens > max_context:
            raise BadRequest(f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds this server's context "
                             f"of {max_context} tokens", param="max_tokens", code="context_length_exceeded")
        structured = structured or self.structured(body)
        if structured.schema is not None:
            self.compile_grammar(structured.schema, "tools" if structured.tools_active else "response_format")
        try:
            stop = body.stop_strings()
        except ValueError as e:
            raise BadRequest(str(e), param="stop", code="invalid_parameter") from None
        try:
            params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                    min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                                    max_new_tokens=max_tokens, stop=stop, seed=body.seed,
                                    ignore_eos=body.ignore_eos, logprobs=k, json_schema=structured.schema)
        except ValueError as e:        # SamplingParams names the field first: "SamplingParams: top_k must be ..."
            field = str(e).removeprefix("SamplingParams: ").split(" ", 1)[0]
            raise BadRequest(str(e), param=field if field in type(body).model_fields else None,
                             code="invalid_parameter") from None
        return _Prepared(prompt_ids, params, stop, body.n, structured)

    def check_model(self, body) -> None:
        if body.model != self.model_name:
            raise BadRequest(f"model {body.model[:200]!r} is not served here; this server serves "
                             f"{self.model_name!r}", param="model", code="model_not_found", status=404)

    def check_fields(self, body) -> None:
        refused = body.refusal()
        if refused is not None:
            raise BadRequest(refused[1], param=refused[0], code="unsupported_parameter")

    # --- from SamplingParams to an answer ------------------------------------------------------------------------
    async def submit(self, prep: _Prepared) -> list[RequestHandle] | JSONResponse:
        """Hand the request's n choices to the engine thread: their handles, or the error response (429 full,
        503 stopping, 400 refused by the engine). Choices 1.. wait in the loop for choice 0's prompt (see
        EngineLoop.submit)."""
        loop, rejected = self.loop, self.metrics.rejected
        handles: list[RequestHandle] = []
        try:
            for i in range(prep.n):
                handles.append(loop.submit(prep.ids, prep.sample_params(i), after=handles[0] if handles else None))
        except Rejected as e:
            for handle in handles:
                loop.abort(handle)
            if not loop.accepting:
                rejected.labels("shutting_down").inc()
                return _error(503, str(e), type_="server_error", code="shutting_down")
            rejected.labels("queue_full").inc()
            return _error(429, str(e), type_="rate_limit_error", code="queue_full",
                          headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        first = await handles[0].queue.get()     # the engine thread's answer: refused, or accepted (no tokens yet)
        if first.refused:
            for handle in handles[1:]:
                loop.abort(handle)
            rejected.labels("invalid").inc()
            return _error(400, first.error or "refused", param="prompt", code="invalid_parameter")
        self.metrics.extra_samples.inc(prep.n - 1)
        return handles

    async def respond(self, request: Request, body, prep: _Prepared, chat: bool):
        got = await self.submit(prep)
        if isinstance(got, JSONResponse):
            return got
        handles, rid = got, new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self.stream(handles, rid, prep, chat, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        task = asyncio.ensure_future(self.collect(handles, prep, chat))
        while not task.done():          # a client that hangs up while waiting for a whole answer is aborted too
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                for handle in handles:
                    self.loop.abort(handle)
                return Response(status_code=499)
        choices, n_out, error = task.result()
        if error and "grammar budget" in error:
            return _error(400, error, param="response_format", code="grammar_too_complex")
        if error:
            return _error(500, error, type_="server_error", code="engine_error")
        make = chat_response if chat else completion_response
        out = make(rid, self.model_name, choices, len(prep.ids), n_out)
        if chat and prep.structured.tools_active:      # the grammar's answer: a call, or the text it wraps
            for c, choice in zip(choices, out["choices"]):
                choice["message"], called = tool_calls.final_message(c.text, prep.structured.mode)
                if called and c.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
        return out

    async def events(self, handles: list[RequestHandle]):
        """(choice index, Event) of all n choices as they come, until each has finished. The first event of each
        handle (accepted) is skipped: choice 0's was read by submit."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, handle: RequestHandle) -> None:
            skip = i > 0
            async for ev in handle.events():
                if skip and not ev.finished and not ev.tokens:
                    skip = False
                    continue
                skip = False
                await merged.put((i, ev))

        tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        left = len(handles)
        try:
            while left:
                i, ev = await merged.get()
                left -= ev.finished
                yield i, ev
        finally:
            for t in tasks:
                t.cancel()

    async def collect(self, handles: list[RequestHandle], prep: _Prepared, chat: bool):
        """The whole answer of a non-streamed request: (choices, output tokens, error or None)."""
        texts = [TextStream(self.tokenizer, prep.stop) for _ in handles]
        pieces: list[list[str]] = [[] for _ in handles]
        reasons: list[str | None] = [None] * len(handles)
        lps = [_LogprobsOf(self.tokenizer) if prep.params.logprobs is not None else None for _ in handles]
        n_out = 0
        try:
            async for i, ev in self.events(handles):
                if reasons[i] is not None:
                    continue                     # stopped by a stop string; its abort is on its way
                if ev.error:
                    return [], n_out, ev.error
                n_out += len(ev.tokens)
                if lps[i] is not None:
                    lps[i].add(ev)
                pieces[i].append(texts[i].push(ev.tokens))
                if texts[i].stopped:
                    reasons[i] = "stop"
                    self.loop.abort(handles[i])
                elif ev.finished:
                    pieces[i].append(texts[i].flush())
                    reasons[i] = FINISH_REASONS.get(ev.finish_reason, "stop")
                if all(r is not None for r in reasons):
                    break
        finally:
            for handle in handles:
                if not handle.done:
                    self.loop.abort(handle)  # a stop string the engine did not see yet, or this task was cancelled
        choices = [Choice("".join(p), r or "stop", lp.whole(chat) if lp is not None else None)
                   for p, r, lp in zip(pieces, reasons, lps)]
        return choices, n_out, None

    async def stream(self, handles: list[RequestHandle], rid: str, prep: _Prepared, chat: bool,
                     include_usage: bool):
        """The SSE body. If the client goes away, Starlette stops iterating it: `finally` aborts the request."""
        t, name = int(time.time()), self.model_name
        texts = [TextStream(self.tokenizer, prep.stop) for _ in handles]
        lps = [_LogprobsOf(self.tokenizer) if prep.params.logprobs is not None else None for _ in handles]
        done = [False] * len(handles)
        n_out = 0
        text_of = [""] * len(handles)            # with tools: the raw output so far

        tools = [tool_calls.DeltaStream(prep.structured.mode) if chat and prep.structured.tools_active else None
                 for _ in handles]

        def chunk(i: int, piece: str, reason: str | None, role: bool = False, logprobs: dict | None = None) -> str:
            if tools[i] is not None and not role:     # the raw grammar output -> content or tool_calls deltas
                return "".join(sse_event(chat_chunk(rid, name, t, d, None, i)) for d in tools[i].push(text_of[i]))
            if chat:
                delta = {"role": "assistant", "content": piece} if role else ({"content": piece} if piece or
                                                                              not reason else {})
                return sse_event(chat_chunk(rid, name, t, delta, reason, i, logprobs))
            return sse_event(completion_chunk(rid, name, t, piece, reason, i, logprobs))

        try:
            if chat:
                for i in range(len(handles)):
                    yield chunk(i, "", None, role=True)
            async for i, ev in self.events(handles):
                if done[i]:
                    continue
                if ev.error:
                    budget = "grammar budget" in ev.error
                    yield sse_event(error_body(ev.error, "invalid_request_error" if budget else "server_error",
                                               code="grammar_too_complex" if budget else "engine_error"))
                    break
                n_out += len(ev.tokens)
                text = texts[i]
                piece = text.push(ev.tokens)
                logprobs = lps[i].part(ev, chat) if lps[i] is not None and ev.tokens else None
                reason = None
                if text.stopped:
                    reason = "stop"
                    self.loop.abort(handles[i])
                elif ev.finished:
                    piece += text.flush()
                    reason = FINISH_REASONS.get(ev.finish_reason, "stop")
                text_of[i] += piece
                if tools[i] is not None:
                    deltas = chunk(i, piece, None) if piece else ""
                    if deltas:
                        yield deltas
                    if reason == "stop" and tools[i].called:
                        reason = "tool_calls"
                elif piece or logprobs:
                    yield chunk(i, piece, None, logprobs=logprobs)
                if reason:
                    done[i] = True
                    yield sse_event(chat_chunk(rid, name, t, {}, reason, i)) if tools[i] is not None else \
                        chunk(i, "", reason)
                    if all(done):
                        if include_usage:
                            yield sse_event({"id": rid, "object": "chat.completion.chunk" if chat else
                                             "text_completion", "created": t, "model": name, "choices": [],
                                             "usage": usage(len(prep.ids), n_out)})
                        break
            yield sse_event("[DONE]")
        finally:
            for handle in handles:
                if not handle.done:
                    self.loop.abort(handle)

    # --- the routes (create_app maps them to URLs) ---------------------------------------------------------------
    # Tokenizing and rendering a chat template take time proportional to the prompt (seconds for megabytes): they
    # run in a worker thread, so the event loop goes on serving the other connections meanwhile.
    def prepare_completion(self, body: CompletionRequest) -> _Prepared:
        self.check_fields(body)
        self.check_model(body)
        return self.prepare(body, self.completion_ids(body), body.max_tokens)

    def prepare_chat(self, body: ChatCompletionRequest) -> _Prepared:
        self.check_fields(body)
        self.check_model(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        structured = self.structured(body)
        return self.prepare(body, self.chat_ids(body, structured), max_tokens, structured)

    # The body itself is parsed and validated in the worker thread as well: megabytes of JSON take pydantic long
    # enough that, on the event loop, every stream would pause for them.
    async def completions(self, request: Request):
        body, prep = await run_in_threadpool(self._parsed, CompletionRequest, await request.body(),
                                             self.prepare_completion)
        return await self.respond(request, body, prep, chat=False)

    async def chat_completions(self, request: Request):
        body, prep = await run_in_threadpool(self._parsed, ChatCompletionRequest, await request.body(),
                                             self.prepare_chat)
        return await self.respond(request, body, prep, chat=True)

    @staticmethod
    def _parsed(model, raw: bytes, prepare):
        try:
            data = json.loads(raw)
        except ValueError as e:        # JSONDecodeError, or bytes that are not UTF-8
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                           "ctx": {"error": str(e)}}]) from None
        except RecursionError:         # nested past Python's recursion limit
            raise BadRequest("the request body nests too deeply", code="invalid_json") from None
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False, include_input=False)) from None
        except RecursionError:
            raise BadRequest("the request body nests too deeply", code="invalid_parameter") from None
        return body, prepare(body)

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "tinyserve", "max_model_len": self.max_context,
                                            "vocab_size": self.vocab_size, **self.path()}]}

    async def health(self):
        loop = self.loop
        snap = loop.snapshot()
        ok = loop.alive and loop.accepting
        status = "ok" if ok else ("draining" if loop.alive else "stopped")
        if loop.failure is not None:
            status = f"failed: {type(loop.failure).__name__}: {loop.failure}"
        return JSONResponse({"status": status, "model": self.model_name, **self.path(), **snap},
                            status_code=200 if ok else 503)

    async def prometheus(self):
        return PlainTextResponse(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# --- errors: every one an OpenAI-style body ------------------------------------------------------------------

async def _invalid(request: Request, exc: RequestValidationError):
    err = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
    request.app.state.metrics.rejected.labels("invalid").inc()
    if err.get("type") == "json_invalid":
        return _error(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}",
                      code="invalid_json")
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    return _error(400, f"{'.'.join(loc) or 'body'}: {err['msg']}", param=loc[0] if loc else None,
                  code="invalid_parameter")


async def _http_error(request: Request, exc: StarletteHTTPException):
    return _error(exc.status_code, str(exc.detail), type_="invalid_request_error" if exc.status_code < 500
                  else "server_error")


async def _bad_request(request: Request, exc: BadRequest):
    request.app.state.metrics.rejected.labels("invalid" if exc.status == 400 else "not_found").inc()
    return _error(exc.status, str(exc), param=exc.param, code=exc.code)


async def _unexpected(request: Request, exc: Exception):
    """Whatever escaped the checks still answers in OpenAI's shape: a body nested past Python's recursion limit
    is the client's fault (400); anything else is a bug of ours (500), logged with its traceback."""
    if isinstance(exc, RecursionError):
        return _error(400, "the request nests too deeply", code="invalid_parameter")
    import traceback
    traceback.print_exception(exc, file=sys.stderr)
    return _error(500, f"internal error: {type(exc).__name__}", type_="server_error", code="internal_error")


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ERRORS = {400: "invalid request: bad JSON, a bad or unsupported field (`param` names it), a prompt too long",
          401: "missing or wrong API key (--api-key)", 404: "the model is not served here",
          413: "body larger than --max-body-size",
          429: "waiting queue full; see Retry-After", 503: "shutting down, or too many connections"}


def _openapi(app: FastAPI) -> dict:
    """FastAPI documents a 422 for every body it validates; this server answers 400 in OpenAI's error shape
    instead (see _invalid), and /metrics is Prometheus text, not JSON: the schema says what the server does."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path, ops in schema["paths"].items():
            for op in ops.values():
                op["responses"].pop("422", None)
                if path.startswith("/v1/") and "requestBody" in op:
                    op["responses"].update({str(code): {"description": why, "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/Error"}}}} for code, why in ERRORS.items()})
        schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {
            "text/plain; version=0.0.4": {"schema": {"type": "string"}}}
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas["Error"] = ERROR_SCHEMA
        for model in (CompletionRequest, ChatCompletionRequest):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(body.pop("$defs", {}))
            schemas[model.__name__] = body
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(engine: Engine, tokenizer, model_name: str, max_waiting: int = 64, kernels=None,
               limits: HttpLimits | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under `model_name`. Its lifespan starts the engine thread and, at
    shutdown (after uvicorn has drained the connections), cancels whatever is still in. kernels (a jit.Kernels):
    how the fast path's kernels came; while they compile in the background, the engine moves to them when ready.
    limits: the API key, body size and timeouts (http_guard.py); ServerThread and main pass the timeouts on to
    uvicorn from app.state.limits."""
    service = OpenAIService(engine, tokenizer, model_name, max_waiting, kernels)
    loop = service.loop
    limits = limits or HttpLimits()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # The GIL passes between threads every switch interval (Python's default: five milliseconds): a thread that
        # lets it go for a moment (the engine thread around every kernel, the event loop around every send) waits up
        # to that long to get it back from a busy worker thread (a request being tokenized or its grammar compiled).
        # A one-millisecond interval shrinks those waits fivefold; the threads' own work does not change.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, 0.001))
        if hasattr(tokenizer, "token_bytes"):     # the vocabulary trie of structured output, before any request
            grammars_for(tokenizer, engine.config.vocab_size, engine.config.eos_token_ids).vocabulary()
        loop.start()
        try:
            yield
        finally:
            sys.setswitchinterval(switch)
            loop.stop(drain=False)       # uvicorn has let the streams finish (or timed out): cancel the rest
            snap = loop.snapshot()
            print(f"tinyserve: stopped ({snap['completed']} completed, {snap['aborted']} cancelled, "
                  f"{snap['errors']} errors, {snap['rejected']} rejected; {snap['kv_blocks_used']} KV blocks still "
                  f"held)", file=sys.stderr, flush=True)

    app = FastAPI(title="tinyserve", lifespan=lifespan)
    app.state.service, app.state.loop, app.state.metrics, app.state.engine = service, loop, service.metrics, engine
    app.state.limits = limits
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(BadRequest, _bad_request)
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(Guard, limits=limits, on_reject=lambda reason: service.metrics.rejected.labels(reason).inc())
    for path, model, route in (("/v1/completions", CompletionRequest, service.completions),
                               ("/v1/chat/completions", ChatCompletionRequest, service.chat_completions)):
        # the route parses its body itself (off the event loop); the OpenAPI document still describes it
        app.post(path, openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}})(route)
    app.get("/v1/models")(service.models)
    app.get("/health")(service.health)
    app.get("/metrics", response_class=PlainTextResponse)(service.prometheus)
    app.openapi = lambda: _openapi(app)
    return app


# --- running it ---------------------------------------------------------------------------------------------

class ServerThread:
    """uvicorn in a background thread on a free loopback port (tests, the notebook, `bench --server`'s tests):

        with ServerThread(create_app(engine, tok, "smollm2")) as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, drain_timeout: float | None = 10):
        import uvicorn
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=drain_timeout,
                                **getattr(app.state, "limits", HttpLimits()).uvicorn_kwargs())
        self.server = uvicorn.Server(config)
        self.app = app
        self._thread = threading.Thread(target=self.server.run, name="tinyserve-http", daemon=True)
        self.url = ""

    def start(self, timeout: float = 30) -> "ServerThread":
        self._thread.start()
        t0 = time.perf_counter()
        while not self.server.started:
            if not self._thread.is_alive() or time.perf_counter() - t0 > timeout:
                raise RuntimeError("the server did not start (port taken? see the log above)")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def build(args, log=None) -> tuple[FastAPI, str]:
    """The app the `serve` subcommand runs, from its options (also used by the tests). The default path is
    generate's: int8 weights on the Numba kernels (`--quant none --backend numpy`: the float32 reference)."""
    from . import jit
    from .cli_options import engine_kwargs, load_for_cli

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    tok, model = load_for_cli(args)
    name = served_name(args.model)
    kernels = None
    if runs_on_kernels(model):
        model, kernels = jit.prepare(model, "engine", args.compile == "background", log)
    engine = Engine(model, tokenizer=tok, prefix_caching=not args.no_prefix_cache, **engine_kwargs(args, model))
    name = args.served_model_name or name
    return create_app(engine, tok, name, max_waiting=args.max_waiting, kernels=kernels,
                      limits=limits_from_args(args)), name


def served_name(model: str) -> str:
    """The `model` clients name by default: the file's or folder's name (smollm2-135m-instruct for the shipped
    folder, SmolLM2-135M-Instruct.Q4_K_M for that GGUF), or tiny."""
    from .cli_options import TINY
    from .zoo import local_path
    return TINY if model == TINY else Path(local_path(model)).name.removesuffix(".gguf")


def main(args) -> int:
    """The `serve` subcommand (see __main__.build_parser)."""
    import uvicorn

    app, name = build(args)
    if not is_loopback(args.host) and app.state.limits.api_key is None:
        print(f"tinyserve: WARNING: serving on {args.host} without an API key: anyone who can reach this port can use "
              f"the model. Set --api-key or TINYSERVE_API_KEY, or bind 127.0.0.1.", file=sys.stderr, flush=True)
    print(f"tinyserve: serving {name!r} on http://{args.host}:{args.port} with "
          f"{describe_backend(app.state.engine.model)} (OpenAI API under /v1; /health and /v1/models say which path "
          f"answers; /metrics)", file=sys.stderr, flush=True)
    # uvicorn handles SIGTERM/SIGINT: stop listening, let the streams in flight finish for up to drain_timeout,
    # then cancel the rest (their finally blocks abort them in the engine) and run the lifespan shutdown, which
    # prints the summary. Then uvicorn re-raises the signal, so the process ends the way its sender expects.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.drain_timeout, **app.state.limits.uvicorn_kwargs())
    return 0
