"""Lesson 8: the server's front door — what a request must get past before the OpenAI routes see it.

    limits = HttpLimits(api_key="sk-...", max_body_size=4 << 20, header_timeout=10, body_timeout=30)
    app = Guard(app, limits, on_reject)      # 401 without the key on /v1/*, 413 for a body over the limit
    uvicorn.run(app, **limits.uvicorn_kwargs())   # keep-alive, header and body timeouts, a connection cap

A server that answers everyone must bound what each connection may cost it before it costs anything: a body
is refused by its Content-Length (or as soon as it outgrows the limit) before a byte of it is parsed, a client
that sends half a header or a body shorter than it announced is cut off when its timeout ends, and beyond
`max_connections` uvicorn answers 503 at once. The API key is compared in constant time (hmac.compare_digest):
a plain `==` returns sooner the earlier the first wrong character, which leaks the key a character at a time.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import os
from dataclasses import dataclass
from typing import Callable

API_KEY_ENV = "TINYSERVE_API_KEY"


@dataclass(slots=True)
class HttpLimits:
    api_key: str | None = None            # Bearer token /v1/* requires (None: open)
    max_body_size: int = 4 << 20          # bytes; a prompt filling SmolLM2's whole context is ~10 KB
    header_timeout: float = 10.0          # seconds from connecting (or the first byte of a next request) to the
                                          # end of its header
    body_timeout: float = 30.0            # seconds from the end of the header to the end of the body
    keep_alive_timeout: float = 5.0       # seconds an idle connection stays open after a response
    max_connections: int | None = 512     # beyond it: 503 (uvicorn's limit_concurrency)

    def __post_init__(self) -> None:
        for name in ("max_body_size", "header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_connections is not None and self.max_connections < 2:
            raise ValueError(f"max_connections must be >= 2, got {self.max_connections!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty")

    def uvicorn_kwargs(self) -> dict:
        # uvicorn counts the connection asking too: limit_concurrency = N lets N - 1 others in, so add one
        return dict(http=timed_h11_protocol(self.header_timeout, self.body_timeout),
                    timeout_keep_alive=self.keep_alive_timeout,
                    limit_concurrency=None if self.max_connections is None else self.max_connections + 1)


def _json_error(status: int, message: str, type_: str, code: str, headers: tuple = ()) -> tuple[dict, dict]:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *headers]}
    return start, {"type": "http.response.body", "body": body, "more_body": False}


class Guard:
    """ASGI middleware: the API key on /v1/*, then the body-size limit. The body is read here, whole, up to the
    limit, and handed to the app from memory; a body over it gets 413 and the connection is closed (the rest of
    it is never read). on_reject(reason) counts refusals (the metrics)."""

    def __init__(self, app, limits: HttpLimits, on_reject: Callable[[str], None] = lambda reason: None):
        self.app, self.limits, self.on_reject = app, limits, on_reject
        self._key = limits.api_key.encode() if limits.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._key is not None and scope["path"].startswith("/v1/") and not self._authorized(scope):
            self.on_reject("unauthorized")
            start, body = _json_error(401, "a valid API key is required: send the header 'Authorization: Bearer "
                                      "<key>'", "invalid_request_error", "invalid_api_key",
                                      ((b"www-authenticate", b"Bearer"),))
            await send(start)
            return await send(body)
        limit = self.limits.max_body_size
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._too_large(send, int(length))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":        # the client left before sending its whole body
                return
            size += len(message.get("body", b""))
            if size > limit:                             # chunked, or longer than it said: stop reading
                return await self._too_large(send, size)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replay = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replayed():
            nonlocal replay
            if replay is not None:
                message, replay = replay, None
                return message
            return await receive()          # after the body: http.disconnect when the client leaves
        return await self.app(scope, replayed, send)

    def _authorized(self, scope) -> bool:
        got = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = got.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    async def _too_large(self, send, size: int):
        self.on_reject("body_too_large")
        start, body = _json_error(413, f"the request body ({size} bytes so far) exceeds this server's limit of "
                                  f"{self.limits.max_body_size} bytes (--max-body-size)", "invalid_request_error",
                                  "body_too_large", ((b"connection", b"close"),))
        await send(start)
        await send(body)


async def service_unavailable(scope, receive, send) -> None:
    """The connection cap's 503, as JSON."""
    start, body = _json_error(503, "too many connections: retry later", "server_error", "too_many_connections",
                              ((b"connection", b"close"), (b"retry-after", b"1")))
    await send(start)
    await send(body)


def timed_h11_protocol(header_timeout: float, body_timeout: float):
    """uvicorn's h11 protocol with the two timeouts uvicorn lacks: a request's header must be complete within
    header_timeout (counted from the connection, or from the first byte of a next request on a kept-alive one)
    and its body within body_timeout of the header. Otherwise the connection is closed: there is no request to
    answer yet (a half header), or its handler is waiting for bytes that do not come (it sees a disconnect)."""
    import h11
    from uvicorn.protocols.http import h11_impl
    from uvicorn.protocols.http.h11_impl import H11Protocol

    # uvicorn answers the connection cap with a plain-text 503 of its own; every error of this server is an OpenAI
    # JSON body, so its module's responder is swapped for one (uvicorn looks the name up on each refusal)
    h11_impl.service_unavailable = service_unavailable

    class TimedH11Protocol(H11Protocol):
        _timer = None
        _phase: str | None = None            # "header" | "body" | None: which deadline runs

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._set("header")

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow()

        def connection_lost(self, exc) -> None:
            self._set(None)
            super().connection_lost(exc)

        def _follow(self) -> None:
            """Which deadline applies now, from h11's view of the client's side of the connection."""
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                self._set("body")
            elif state is h11.IDLE and self.conn.trailing_data[0]:     # part of a header is buffered
                self._set("header")
            elif state is not h11.IDLE or self._phase == "body":
                self._set(None)            # the request is in; an idle kept-alive connection is uvicorn's

        def _set(self, phase: str | None) -> None:
            if phase == self._phase:
                return                     # a deadline runs from its phase's start, not from the last byte
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._phase = phase
            if phase is not None:
                seconds = header_timeout if phase == "header" else body_timeout
                self._timer = self.loop.call_later(seconds, self._expire)

        def _expire(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.logger.info("closing a connection whose request %s did not arrive in time", self._phase)
                self.transport.close()

    return TimedH11Protocol


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False                       # a host name: it may resolve to anything


def add_http_options(parser) -> None:
    """The serve command's options for the front door (see HttpLimits for the defaults' reasons)."""
    d = HttpLimits()
    g = parser.add_argument_group("limits and authentication")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require 'Authorization: Bearer <key>' on /v1/* (default: ${API_KEY_ENV}; /health stays "
                        f"open)")
    g.add_argument("--max-body-size", type=int, default=d.max_body_size,
                   help="largest request body in bytes; beyond it: HTTP 413 before parsing")
    g.add_argument("--timeout-header", type=float, default=d.header_timeout,
                   help="seconds a client has to send a request's header")
    g.add_argument("--timeout-body", type=float, default=d.body_timeout,
                   help="seconds a client has to send a request's body, once the header is in")
    g.add_argument("--timeout-keep-alive", type=float, default=d.keep_alive_timeout,
                   help="seconds an idle connection stays open between requests")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="concurrent connections; beyond them: HTTP 503")


def limits_from_args(args) -> HttpLimits:
    return HttpLimits(api_key=args.api_key, max_body_size=args.max_body_size, header_timeout=args.timeout_header,
                      body_timeout=args.timeout_body, keep_alive_timeout=args.timeout_keep_alive,
                      max_connections=args.max_connections)
