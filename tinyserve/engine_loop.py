"""Lesson 8: the engine in a loop of its own — the bridge between many concurrent HTTP requests and one Engine.

The Engine is not thread-safe and its step() takes tens of milliseconds: it cannot run inside the web server's
event loop (every other connection would freeze for a step) and it must not be called from many threads. So one
thread owns it. Requests reach that thread through a thread-safe inbox; between two steps the thread drains the
inbox (add, abort), runs one step, and hands each new token to its request's asyncio queue with
`call_soon_threadsafe` (the only safe way into another thread's event loop). A request never waits for another
one: they all join the same continuously batched step.

    loop = EngineLoop(engine, max_waiting=64); loop.start()
    handle = loop.submit(prompt_ids, params)     # Rejected if the waiting queue is full (-> HTTP 429)
    async for ev in handle.events(): ...         # Event(tokens, finished, finish_reason, error)
    loop.abort(handle)                           # the client went away: its KV blocks are freed at the next step
    loop.stop(drain=True)                        # finish what is running (SIGTERM), or cancel it (drain=False)
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence as Seq

from .engine import Engine
from .sampling import SamplingParams


class Rejected(Exception):
    """The waiting queue is full (or the loop is shutting down): the caller answers 429 / 503."""


@dataclass(slots=True)
class Event:
    """What the engine thread tells one request. The first event of every request answers add_request: refused
    (finished, refused=True, error = the reason) or accepted (no tokens, not finished); then one per step."""
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None   # "eos" | "length" | "context" | "stop" | "abort" | "error"
    error: str | None = None           # refused by add_request (a ValueError's sentence) or failed in a step
    refused: bool = False              # error came from add_request: the request never ran (-> HTTP 400)
    logprobs: list | None = None       # per token of `tokens` (params.logprobs set): sampling.token_logprobs


@dataclass(slots=True, eq=False)
class RequestHandle:
    """One request as the server sees it. Written by the engine thread, read by the request's coroutine."""
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)   # when the HTTP handler got it (TTFT starts here)
    request_id: int | None = None      # the engine's id, once added
    queued: bool = True                # counted in the bounded waiting queue until the engine admits it
    num_output: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    done: bool = False
    after: "RequestHandle | None" = None   # join the engine only once this one has its first token (see submit)

    def _push(self, ev: Event) -> None:            # engine thread -> this request's event loop
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:                       # that loop is closed (server gone): nobody is listening
            pass

    async def events(self) -> AsyncIterator[Event]:
        while True:
            ev = await self.queue.get()
            yield ev
            if ev.finished:
                return


@dataclass(slots=True)
class LoopStats:
    """Counters of the loop's life (read by /health and the tests)."""
    submitted: int = 0
    rejected: int = 0
    completed: int = 0        # finished by the engine (eos, length, context, stop)
    aborted: int = 0          # cancelled: the client left or the server shut down
    errors: int = 0
    steps: int = 0


class Observer:
    """Hooks the loop calls from its thread (the Prometheus metrics implement them; the default does nothing)."""
    def on_token(self, handle: RequestHandle, now: float) -> None: ...
    def on_finish(self, handle: RequestHandle, reason: str, hit_tokens: int, prompt_tokens: int) -> None: ...
    def on_step(self, engine: Engine, loop: "EngineLoop") -> None: ...


class EngineLoop:
    def __init__(self, engine: Engine, max_waiting: int = 64, observer: Observer | None = None,
                 idle_wait: float = 0.05):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.observer = observer or Observer()
        self.idle_wait = idle_wait
        self.stats = LoopStats()
        self._inbox: queue.SimpleQueue[tuple[str, RequestHandle]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()           # guards _num_queued and _accepting (HTTP side vs engine thread)
        self._num_queued = 0                    # submitted, not yet admitted by the engine (the bounded queue)
        self._accepting = True
        self._live: dict[int, RequestHandle] = {}    # engine request id -> handle (engine thread only)
        self._deferred: list[RequestHandle] = []     # submitted with `after` still in its prefill (engine thread)
        self._stop: str | None = None           # None | "drain" | "cancel"
        self._thread = threading.Thread(target=self._run, name="tinyserve-engine", daemon=True)
        self.failure: BaseException | None = None

    # --- called from the HTTP side (any thread) ------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, prompt_ids: Seq[int], params: SamplingParams,
               loop: asyncio.AbstractEventLoop | None = None, after: RequestHandle | None = None) -> RequestHandle:
        """after: another request on the same prompt (the n samples of one API request). This one reaches the engine
        once `after` has its first token: its prompt is then computed and its full blocks are in the prefix cache,
        so this one reuses them instead of computing the same prompt again beside it in the same step."""
        handle = RequestHandle(list(prompt_ids), params, loop or asyncio.get_running_loop(), after=after)
        with self._lock:
            if not self._accepting:
                raise Rejected("the server is shutting down")
            if self._num_queued >= self.max_waiting:
                self.stats.rejected += 1
                raise Rejected(f"the waiting queue is full ({self.max_waiting} requests): retry later")
            self._num_queued += 1
            self.stats.submitted += 1
        self._send("add", handle)
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request (its client is gone). Safe to call at any time, also after it finished."""
        if not handle.done:
            self._send("abort", handle)

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new requests; then finish every request already in (drain) or cancel them all, and join."""
        with self._lock:
            self._accepting = False
        self._stop = "drain" if drain else "cancel"
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive() and drain:      # the drain took too long: cancel what is left
            self._stop = "cancel"
            self._wake.set()
            self._thread.join()

    @property
    def num_queued(self) -> int:
        return self._num_queued

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _send(self, kind: str, handle: RequestHandle) -> None:
        self._inbox.put((kind, handle))
        self._wake.set()

    # --- the engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._drain_inbox()
                self._release_deferred()
                if self._stop == "cancel" or (self._stop == "drain" and not engine.has_unfinished()):
                    break
                if not engine.has_unfinished():
                    self._wake.wait(self.idle_wait)
                    self._wake.clear()
                    continue
                try:
                    outputs = engine.step()
                except Exception as e:    # a bug in the step: fail every live request rather than hang them all
                    self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                    continue
                self.stats.steps += 1
                self._dispatch(outputs)
                self._release_deferred()
                self._update_queued()
                self.observer.on_step(engine, self)
        except BaseException as e:       # never die silently: the server reports it on /health
            self.failure = e
            raise
        finally:
            for handle in list(self._live.values()):   # stopped with requests still in: cancel them
                self._finish(handle, "abort", abort=True)
            self._drain_inbox(refuse=True)
            for handle in self._deferred:
                self._inbox.put(("add", handle))
            self._deferred.clear()
            self._drain_inbox(refuse=True)

    def _drain_inbox(self, refuse: bool = False) -> None:
        while True:
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and handle.after is not None and not refuse and not self._ready(handle):
                self._deferred.append(handle)
            elif kind == "add":
                if refuse or self._stop == "cancel":
                    self._unqueue(handle)
                    handle.done = True
                    self.stats.aborted += 1
                    handle._push(Event([], True, "abort", "the server is shutting down"))
                    continue
                try:
                    rid = self.engine.add_request(handle.prompt_ids, handle.params)
                except ValueError as e:   # could never be served (too long for the context or the pool, ...)
                    self._unqueue(handle)
                    handle.done = True
                    self.stats.errors += 1
                    handle._push(Event([], True, "error", str(e), refused=True))
                    continue
                handle.request_id = rid
                self._live[rid] = handle
                handle._push(Event([]))      # accepted: the HTTP side may now answer 200 and start streaming
            elif kind == "abort" and handle in self._deferred:     # never reached the engine
                self._deferred.remove(handle)
                self._unqueue(handle)
                handle.done = True
                self.stats.aborted += 1
                handle._push(Event([], True, "abort"))
            elif kind == "abort" and handle.request_id in self._live and not handle.done:
                self._finish(handle, "abort", abort=True)

    @staticmethod
    def _ready(handle: RequestHandle) -> bool:
        return handle.after.first_token_time is not None or handle.after.done

    def _release_deferred(self) -> None:
        """Requests whose `after` now has its first token (or ended) go to the engine: back through the inbox."""
        ready = [h for h in self._deferred if self._ready(h)]
        if ready:
            self._deferred = [h for h in self._deferred if not self._ready(h)]
            for handle in ready:
                self._inbox.put(("add", handle))
            self._drain_inbox()

    def _dispatch(self, outputs) -> None:
        now = time.perf_counter()
        for out in outputs:
            handle = self._live.get(out.request_id)
            if handle is None:
                continue
            if out.new_tokens:
                if handle.first_token_time is None:
                    handle.first_token_time = now
                handle.num_output += len(out.new_tokens)
                self.observer.on_token(handle, now)
                handle.last_token_time = now
            if out.finished:            # out.error: a request that failed inside step() (finish_reason "error")
                self._finish(handle, out.finish_reason or "error", tokens=list(out.new_tokens), error=out.error,
                             logprobs=out.logprobs)
            else:
                handle._push(Event(list(out.new_tokens), logprobs=out.logprobs))

    def _finish(self, handle: RequestHandle, reason: str, tokens: list[int] | None = None,
                error: str | None = None, abort: bool = False, logprobs: list | None = None) -> None:
        rid = handle.request_id
        if abort:
            self.engine.abort(rid)      # frees its blocks now; it moves to `finished` with reason "abort"
        self._unqueue(handle)
        hit, n_prompt = self.engine.blocks.hits.get(rid, (0, len(handle.prompt_ids)))
        self.engine.pop_finished(rid)
        del self._live[rid]
        handle.done = True
        if reason == "abort":
            self.stats.aborted += 1
        elif reason == "error":
            self.stats.errors += 1
        else:
            self.stats.completed += 1
        self.observer.on_finish(handle, reason, hit, n_prompt)
        handle._push(Event(tokens or [], True, reason, error, logprobs=logprobs))

    def _fail_all(self, message: str) -> None:
        for handle in list(self._live.values()):
            self._finish(handle, "error", error=message, abort=True)

    def _unqueue(self, handle: RequestHandle) -> None:
        if handle.queued:
            handle.queued = False
            with self._lock:
                self._num_queued -= 1

    def _update_queued(self) -> None:
        """Requests the engine admitted this step leave the bounded waiting queue."""
        waiting = {seq.request_id for seq in self.engine.waiting}
        for handle in self._live.values():
            if handle.queued and handle.request_id not in waiting:
                self._unqueue(handle)

    # --- views for /health and the tests (engine thread's data, read without a lock: a snapshot) ------------
    def snapshot(self) -> dict:
        engine = self.engine
        alloc = engine.blocks.allocator
        cache = engine.blocks.cache
        evictable = cache.num_evictable if cache is not None else 0
        return {"running": len(engine.running), "waiting": len(engine.waiting), "queued": self._num_queued,
                "live_requests": len(self._live) + len(self._deferred),
                "kv_blocks_total": alloc.num_blocks,
                # blocks some request holds; blocks only the prefix cache holds are free memory in all but name
                "kv_blocks_used": alloc.num_used - evictable,
                "kv_blocks_cached": cache.num_cached if cache is not None else 0,
                "submitted": self.stats.submitted, "rejected": self.stats.rejected,
                "completed": self.stats.completed, "aborted": self.stats.aborted, "errors": self.stats.errors,
                "steps": self.stats.steps}
