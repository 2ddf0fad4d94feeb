"""Lesson 8: an OpenAI-compatible HTTP server on the continuous-batching Engine (`python -m tinyserve serve`).

    POST /v1/completions, /v1/chat/completions    streamed as server-sent events (stream=true) or one JSON body
    GET  /v1/models, /health, /metrics            the served model; liveness + pool state; Prometheus text format

FastAPI parses and validates requests and uvicorn speaks HTTP (the libraries vLLM and SGLang use for this); the
Engine runs in its own thread (engine_loop.py). Each request is a coroutine that tokenizes, submits, and then
only waits on its own queue of tokens, so a slow client or a long prompt never blocks anyone else. The rules:

  - a full waiting queue answers 429 at once (bounded memory, and the client learns to back off),
  - malformed JSON, an unknown model, bad parameters and prompts longer than the context answer 400 with an
    OpenAI-style body {"error": {"message", "type", "param", "code"}},
  - a client that disconnects is aborted: its KV blocks return to the pool at the next step boundary,
  - SIGTERM stops accepting connections, lets the streams in flight finish (up to --drain-timeout), then cancels
    what is left and exits. Binds 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .cli_options import describe_backend
from .engine import Engine
from .engine_loop import EngineLoop, Observer, Rejected, RequestHandle
from .protocol import (FINISH_REASONS, ChatCompletionRequest, CompletionRequest, TextStream, chat_chunk,
                       chat_response, completion_chunk, completion_response, error_body, new_id, sse_event, usage)
from .sampling import SamplingParams
from .structured_api import Structured, StructuredError, structured_output, tool_call_message
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
        self._hits = [0, 0]

    def on_token(self, handle: RequestHandle, now: float) -> None:
        if handle.last_token_time is None:        # the loop sets it after this call: this is the first token
            self.ttft.observe(now - handle.arrival)
        else:
            self.itl.observe(now - handle.last_token_time)
        self.generation_tokens.inc()

    def on_finish(self, handle: RequestHandle, reason: str, hit_tokens: int, prompt_tokens: int) -> None:
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
        from .jit import warm_up
        k = self.kernels
        if not k.bg.wait():
            self.status = f"the background compile failed (see {k.bg.log_path}); serving on the NumPy path"
            print(f"tinyserve: {self.status}", file=sys.stderr, flush=True)
            return
        k.seconds = k.bg.seconds
        k.load_seconds = warm_up(k.fast.quant, k.bg.workload)    # in this thread: the engine keeps stepping
        self.ready.set()

    def on_token(self, handle, now) -> None:
        self.inner.on_token(handle, now)

    def on_finish(self, handle, reason, hit_tokens, prompt_tokens) -> None:
        self.inner.on_finish(handle, reason, hit_tokens, prompt_tokens)

    def on_step(self, engine: Engine, loop: EngineLoop) -> None:
        from .jit import use_model
        self.inner.on_step(engine, loop)
        if self.ready.is_set() and self.kernels.switched_at is None:
            use_model(engine, self.kernels.fast)
            self.kernels.switched(loop.stats.steps)
            self.status = f"compiled in the background in {self.kernels.seconds:.1f} s (first run only)"
            print(f"tinyserve: the fast path's kernels are ready ({self.status}); now serving on "
                  f"{describe_backend(engine.model)}", file=sys.stderr, flush=True)


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(slots=True)
class _Prepared:
    ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    structured: Structured = Structured()     # response_format / tools (structured_api.py)


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
        try:
            return self.tokenizer.encode(text)
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

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        return self.encode(self.tokenizer.apply_chat_template(messages), "messages")

    def prepare(self, body, prompt_ids: list[int], max_tokens: int | None) -> _Prepared:
        """Check what the engine would refuse later, with an OpenAI-style reason now."""
        if body.model != self.model_name:
            raise BadRequest(f"model {body.model!r} is not served here; this server serves {self.model_name!r}",
                             param="model", code="model_not_found")
        if body.logprobs not in (None, False, 0):
            raise BadRequest("logprobs are not supported by tinyserve", param="logprobs", code="unsupported")
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
        extra = body.model_extra or {}
        if isinstance(body, CompletionRequest) and extra.get("tools") is not None:
            raise BadRequest("tools are for /v1/chat/completions (the answer is a tool_calls message)", param="tools")
        try:
            structured = structured_output(extra.get("response_format"), extra.get("tools"),
                                           extra.get("tool_choice"), body.stream)
        except StructuredError as e:
            raise BadRequest(str(e), param=e.param, code="invalid_parameter") from None
        try:
            stop = body.stop_strings()
            params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                    min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                                    max_new_tokens=max_tokens, stop=stop, seed=body.seed,
                                    ignore_eos=body.ignore_eos, json_schema=structured.schema)
        except ValueError as e:
            raise BadRequest(str(e), param="stop" if "stop" in str(e) else None, code="invalid_parameter") from None
        return _Prepared(prompt_ids, params, stop, structured)

    # --- from SamplingParams to an answer ------------------------------------------------------------------------
    async def submit(self, prep: _Prepared) -> RequestHandle | JSONResponse:
        """Hand the request to the engine thread: its handle, or the error response (429 full, 503 stopping)."""
        loop, rejected = self.loop, self.metrics.rejected
        try:
            handle = loop.submit(prep.ids, prep.params)
        except Rejected as e:
            if not loop.accepting:
                rejected.labels("shutting_down").inc()
                return _error(503, str(e), type_="server_error", code="shutting_down")
            rejected.labels("queue_full").inc()
            return _error(429, str(e), type_="rate_limit_error", code="queue_full")
        first = await handle.queue.get()       # the engine thread's answer: refused, or accepted (no tokens yet)
        if first.refused:
            rejected.labels("invalid").inc()
            return _error(400, first.error or "refused", param="prompt", code="invalid_parameter")
        return handle

    async def respond(self, request: Request, body, prep: _Prepared, chat: bool):
        got = await self.submit(prep)
        if isinstance(got, JSONResponse):
            return got
        handle, rid = got, new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self.stream(handle, rid, prep, chat, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        task = asyncio.ensure_future(self.collect(handle, prep))
        while not task.done():          # a client that hangs up while waiting for a whole answer is aborted too
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                self.loop.abort(handle)
                return Response(status_code=499)
        text, reason, n_out, error = task.result()
        if error:
            return _error(500, error, type_="server_error", code="engine_error")
        make = chat_response if chat else completion_response
        out = make(rid, self.model_name, text, reason, len(prep.ids), n_out)
        if chat and prep.structured.is_tool_call:      # a forced tool call: its arguments are the answer
            out["choices"][0]["message"] = tool_call_message(prep.structured, text)
            out["choices"][0]["finish_reason"] = "tool_calls" if reason == "stop" else reason
        return out

    async def collect(self, handle: RequestHandle, prep: _Prepared):
        """The whole answer of a non-streamed request: (text, finish reason, output tokens, error or None)."""
        text = TextStream(self.tokenizer, prep.stop)
        pieces, n_out = [], 0
        try:
            async for ev in handle.events():
                if ev.error:
                    return "", "error", n_out, ev.error
                n_out += len(ev.tokens)
                pieces.append(text.push(ev.tokens))
                if text.stopped:
                    return "".join(pieces), "stop", n_out, None
                if ev.finished:
                    pieces.append(text.flush())
                    return "".join(pieces), FINISH_REASONS.get(ev.finish_reason, "stop"), n_out, None
        finally:
            if not handle.done:
                self.loop.abort(handle)  # a stop string the engine did not see yet, or this task was cancelled
        return "".join(pieces), "stop", n_out, None

    async def stream(self, handle: RequestHandle, rid: str, prep: _Prepared, chat: bool, include_usage: bool):
        """The SSE body. If the client goes away, Starlette stops iterating it: `finally` aborts the request."""
        t, name = int(time.time()), self.model_name
        text = TextStream(self.tokenizer, prep.stop)
        n_out = 0

        def chunk(piece: str, reason: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": piece} if role else ({"content": piece} if piece or
                                                                              not reason else {})
                return sse_event(chat_chunk(rid, name, t, delta, reason))
            return sse_event(completion_chunk(rid, name, t, piece, reason))

        try:
            if chat:
                yield chunk("", None, role=True)
            async for ev in handle.events():
                if ev.error:
                    yield sse_event(error_body(ev.error, "server_error", code="engine_error"))
                    break
                n_out += len(ev.tokens)
                piece = text.push(ev.tokens)
                reason = None
                if text.stopped:
                    reason = "stop"
                elif ev.finished:
                    piece += text.flush()
                    reason = FINISH_REASONS.get(ev.finish_reason, "stop")
                if piece:
                    yield chunk(piece, None)
                if reason:
                    yield chunk("", reason)
                    if include_usage:
                        yield sse_event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                         "created": t, "model": name, "choices": [],
                                         "usage": usage(len(prep.ids), n_out)})
                    break
            yield sse_event("[DONE]")
        finally:
            if not handle.done:
                self.loop.abort(handle)

    # --- the routes (create_app maps them to URLs) ---------------------------------------------------------------
    async def completions(self, request: Request, body: CompletionRequest):
        return await self.respond(request, body, self.prepare(body, self.completion_ids(body), body.max_tokens),
                                  chat=False)

    async def chat_completions(self, request: Request, body: ChatCompletionRequest):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await self.respond(request, body, self.prepare(body, self.chat_ids(body), max_tokens), chat=True)

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
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


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
    request.app.state.metrics.rejected.labels("invalid").inc()
    return _error(400, str(exc), param=exc.param, code=exc.code)


def create_app(engine: Engine, tokenizer, model_name: str, max_waiting: int = 64, kernels=None) -> FastAPI:
    """The FastAPI app serving `engine` under `model_name`. Its lifespan starts the engine thread and, at
    shutdown (after uvicorn has drained the connections), cancels whatever is still in. kernels (a jit.Kernels):
    how the fast path's kernels came; while they compile in the background, the engine moves to them when ready."""
    service = OpenAIService(engine, tokenizer, model_name, max_waiting, kernels)
    loop = service.loop

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        try:
            yield
        finally:
            loop.stop(drain=False)       # uvicorn has let the streams finish (or timed out): cancel the rest
            snap = loop.snapshot()
            print(f"tinyserve: stopped ({snap['completed']} completed, {snap['aborted']} cancelled, "
                  f"{snap['errors']} errors, {snap['rejected']} rejected; {snap['kv_blocks_used']} KV blocks still "
                  f"held)", file=sys.stderr, flush=True)

    app = FastAPI(title="tinyserve", lifespan=lifespan)
    app.state.service, app.state.loop, app.state.metrics, app.state.engine = service, loop, service.metrics, engine
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(BadRequest, _bad_request)
    app.post("/v1/completions")(service.completions)
    app.post("/v1/chat/completions")(service.chat_completions)
    app.get("/v1/models")(service.models)
    app.get("/health")(service.health)
    app.get("/metrics")(service.prometheus)
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
                                timeout_graceful_shutdown=drain_timeout)
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
    name = "tiny" if args.model == "tiny" else "smollm2-135m-instruct"
    kernels = None
    if model.backend == "numba" and model.quant != "none":
        model, kernels = jit.prepare(model, "engine", args.compile == "background", log)
    engine = Engine(model, tokenizer=tok, prefix_caching=not args.no_prefix_cache, **engine_kwargs(args, model))
    name = args.served_model_name or name
    return create_app(engine, tok, name, max_waiting=args.max_waiting, kernels=kernels), name


def main(args) -> int:
    """The `serve` subcommand (see __main__.build_parser)."""
    import uvicorn

    app, name = build(args)
    print(f"tinyserve: serving {name!r} on http://{args.host}:{args.port} with "
          f"{describe_backend(app.state.engine.model)} (OpenAI API under /v1; /health and /v1/models say which path "
          f"answers; /metrics)", file=sys.stderr, flush=True)
    # uvicorn handles SIGTERM/SIGINT: stop listening, let the streams in flight finish for up to drain_timeout,
    # then cancel the rest (their finally blocks abort them in the engine) and run the lifespan shutdown, which
    # prints the summary. Then uvicorn re-raises the signal, so the process ends the way its sender expects.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.drain_timeout)
    return 0
