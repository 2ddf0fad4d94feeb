"""Lesson 8: the OpenAI wire format — request bodies, response bodies, server-sent events, stop strings in a stream.

Everything here is pure (no engine, no network), so it can be read and tested on its own:

  - the request models (pydantic: FastAPI validates a body against them; an invalid one becomes a 400 with an
    OpenAI-style error body, see server.py),
  - `sse_event` / `parse_sse`: one server-sent event per chunk, `data: {json}\\n\\n`, ended by `data: [DONE]`,
  - `TextStream`: token ids -> text pieces safe to send: whole UTF-8 characters only (the tokenizer's
    StreamDecoder), and never the beginning of a stop string that may still complete (it is held back; when it
    completes, the text is cut before it and the request ends).
"""
from __future__ import annotations

import json
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# --- requests ------------------------------------------------------------------------------------------------
# strict=True: a value of the wrong JSON type is refused, not coerced (`"stream": "yes"`, `"max_tokens": true`
# are 400s, as at OpenAI); an integer is still a valid float.

class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


# OpenAI fields tinyserve does not honour, with the value that means "off": any other value would change the answer,
# so it is refused with a 400 naming the field instead of being dropped.
UNSUPPORTED = {"best_of": 1, "suffix": "", "logit_bias": {}, "frequency_penalty": 0, "presence_penalty": 0,
               "functions": [], "function_call": "none", "audio": None, "modalities": ["text"], "prediction": None,
               "reasoning_effort": None, "verbosity": None, "web_search_options": None}
# OpenAI fields that do not change the answer: accepted and ignored
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
# structured output (JSON schemas, tool calls) is another module's; its fields are checked there
STRUCTURED = frozenset({"response_format", "tools", "tool_choice", "parallel_tool_calls"})
MAX_N = 16                 # choices per request: each is a request of its own in the engine


class _SamplingFields(BaseModel):
    """The fields both endpoints share. Every OpenAI field is either honoured or refused (a 400 naming it): see
    UNSUPPORTED and IGNORED; a field OpenAI does not know is refused too, as OpenAI does."""
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)        # OpenAI's default and range; 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)                      # choices: n requests sharing the prompt's KV blocks
    # extensions (as vLLM names them): more sampling knobs, and fixed-length outputs for benchmarks
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False

    def stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(stops)}")
        return stops

    def refusal(self) -> tuple[str, str] | None:
        """(field, why) for the first field this server cannot honour, or None."""
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED or name in STRUCTURED:
                continue
            if name not in UNSUPPORTED:
                return name, f"unrecognized request argument supplied: {name}"
            if value is not None and value != UNSUPPORTED[name]:
                return name, f"{name} is not supported by tinyserve (only {UNSUPPORTED[name]!r} or null)"
        return None

    def num_logprobs(self) -> int | None:
        """How many alternatives to report per token (0: only the chosen token's), or None: no logprobs."""
        raise NotImplementedError


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False
    max_tokens: int | None = Field(16, ge=1)               # OpenAI's default for /v1/completions
    logprobs: int | None = Field(None, ge=0, le=5)         # OpenAI's legacy form: the number of alternatives

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str
    arguments: str                       # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message. The agent loop's two kinds: an assistant message carrying `tool_calls` (its content may then be
    null or empty), and a `tool` message answering one of them by `tool_call_id`."""
    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]   # developer: the newer name of system
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None              # a participant's name: accepted, not shown to the model

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def template_role(self) -> str:
        """The role the chat template knows: OpenAI's `developer` messages are what `system` was."""
        return "system" if self.role == "developer" else self.role

    def problem(self) -> tuple[str, str] | None:
        """(field, why) if this message is not one tinyserve can render, else None."""
        if self.tool_calls is not None and self.role != "assistant":
            return "tool_calls", f"only assistant messages carry tool_calls, not a {self.role} message"
        if self.tool_calls is not None and not self.tool_calls:
            return "tool_calls", "tool_calls must not be empty (leave it out)"
        if (self.tool_call_id is None) != (self.role != "tool"):
            return ("tool_call_id", "a tool message needs the tool_call_id of the call it answers"
                    if self.role == "tool" else "only tool messages carry a tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            return "content", f"a {self.role} message needs content (null only for an assistant's tool_calls)"
        return None

    def as_dict(self) -> dict:
        """The message for tool_calls.render_generic or a tool-aware chat template."""
        out = {"role": self.template_role(), "content": self.text() if self.content is not None else None}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


MAX_MESSAGES = 4096        # a chat of more messages than this does not fit SmolLM2's context anyway


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)   # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("messages", mode="before")
    @classmethod
    def _few_enough(cls, v):
        # checked before any message is validated: otherwise pydantic validates every one of a huge list (holding
        # the GIL) before its length check refuses it
        if isinstance(v, list) and len(v) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} messages, got {len(v)}")
        return v

    def refusal(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        for i, m in enumerate(self.messages):
            bad = m.problem()
            if bad is not None:
                return f"messages.{i}.{bad[0]}", f"messages.{i}.{bad[0]}: {bad[1]}"
        return super().refusal()

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# --- responses -----------------------------------------------------------------------------------------------

# the engine's finish reasons -> OpenAI's: an end-of-sequence token and a stop string are both "stop"; running
# out of max_tokens or out of context are both "length"
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None, index: int = 0,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None, index: int = 0,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


@dataclass(slots=True)
class Choice:
    """One of the n answers of a request, as the server collected it."""
    text: str
    finish_reason: str
    logprobs: dict | None = None


def completion_response(rid: str, model: str, choices: list[Choice], n_prompt: int, n_out: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                        for i, c in enumerate(choices)],
            "usage": usage(n_prompt, n_out)}


def chat_response(rid: str, model: str, choices: list[Choice], n_prompt: int, n_out: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": c.logprobs,
                         "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
            "usage": usage(n_prompt, n_out)}


class Logprobs:
    """sampling.token_logprobs results -> OpenAI's two logprobs shapes. A token's text is its own bytes (a
    byte-level token may be half a character: `bytes` is exact, `token` shows U+FFFD there, as OpenAI's does)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.offset = 0                  # completions' text_offset: characters of the tokens before
        if tokenizer not in _TOKEN_BYTES and hasattr(tokenizer, "token_bytes"):
            _TOKEN_BYTES[tokenizer] = tokenizer.token_bytes()      # [V], once per tokenizer: it walks the whole vocabulary
        self.table = _TOKEN_BYTES.get(tokenizer)

    def token_bytes(self, i: int) -> bytes:
        b = self.table[i] if self.table is not None and 0 <= i < len(self.table) else None
        return b if b is not None else self.tokenizer.decode([i]).encode("utf-8")   # a special token: its text

    def piece(self, i: int) -> str:
        return self.token_bytes(i).decode("utf-8", errors="replace")

    def chat(self, tokens: list[int], entries: list) -> dict:
        def one(i: int, lp: float) -> dict:
            return {"token": self.piece(i), "logprob": lp, "bytes": list(self.token_bytes(i))}
        return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in top]}
                            for t, (lp, top) in zip(tokens, entries)]}

    def completion(self, tokens: list[int], entries: list) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, (lp, top) in zip(tokens, entries):
            piece = self.piece(t)
            out["tokens"].append(piece)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self.piece(a): alp for a, alp in top})
            out["text_offset"].append(self.offset)
            self.offset += len(piece)
        return out


_TOKEN_BYTES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # tokenizer -> its token_bytes() table


# --- server-sent events --------------------------------------------------------------------------------------

def sse_event(data: dict | str) -> str:
    """One server-sent event carrying `data`: a dict is sent as compact JSON, a str (e.g. "[DONE]") as is.

    The frame is `data: <payload>\\n\\n`: the blank line ends the event. JSON never contains a raw newline (it
    escapes them), so one `data:` line is always enough. Non-ASCII is escaped as well (\\u00e9): SSE lines end
    only at CR or LF, but many clients split with str.splitlines(), which also breaks at U+0085, U+2028, U+001C...
    """
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    if "\n" in payload or "\r" in payload:
        raise ValueError("an SSE data line cannot contain a newline: send JSON, which escapes them")
    return f"data: {payload}\n\n"


def parse_sse(lines: Iterable[str]) -> Iterable[dict | str]:
    """The inverse, for clients: yields each event's payload (parsed JSON, or the string "[DONE]")."""
    for line in lines:
        line = line.rstrip("\r\n")
        if not line.startswith("data:"):
            continue               # blank separators, comments (": ping") and other fields
        payload = line[5:].lstrip(" ")
        yield payload if payload == "[DONE]" else json.loads(payload)


# --- text of a token stream, with stop strings ----------------------------------------------------------------

class TextStream:
    """Token ids in, text pieces out: whole characters only, and never a prefix of a stop string too early.

    A stop string may arrive split over several tokens ("\\n\\n" as "\\n" + "\\n", "END" as "E" + "ND"): the text
    that could still become one is held back until it either completes (then everything from it on is dropped
    and `stopped` is set) or cannot any more (then it is released). OpenAI's rule: the stop string itself is
    never part of the output.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.decoder = tokenizer.stream_decoder()
        self.stop = stop
        self.held = ""            # decoded, not yet sent: may be the start of a stop string
        self.stopped = False
        self.text = ""            # everything sent so far

    def push(self, tokens: Iterable[int]) -> str:
        return self._release(self.held + "".join(self.decoder.push(t) for t in tokens), final=False)

    def flush(self) -> str:
        return self._release(self.held + self.decoder.flush(), final=True)

    def _release(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if cuts:
            out, self.held, self.stopped = text[:min(cuts)], "", True
        elif final:
            out, self.held = text, ""
        else:
            keep = held_back(text, self.stop)
            out, self.held = text[:len(text) - keep], text[len(text) - keep:]
        self.text += out
        return out


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` must wait: the longest tail that is a proper prefix of a stop
    string (it could still complete with the next token)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
