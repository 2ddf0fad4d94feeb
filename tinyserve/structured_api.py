"""Structured output on the OpenAI wire: `response_format`, `tools` and `tool_choice` -> one JSON schema for the
Engine (SamplingParams.json_schema), and a tool call's answer message. Pure: no engine, no network.

  response_format {"type": "text"}                          free text
  response_format {"type": "json_object"}                   any JSON object
  response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                            JSON valid under `schema` (always enforced, strict or not)
  tools + tool_choice {"type": "function", "function": {"name": N}}
                                                            the arguments of N (its `parameters` schema); the answer is
                                                            a `tool_calls` message, finish_reason "tool_calls"
  tools + tool_choice "required"                            one call of any listed function: the model writes
                                                            {"name": N, "arguments": {...}} under an anyOf of the tools
  tools + tool_choice "none"                                the tools are ignored

Refused (400, naming the parameter): tool_choice "auto" or absent with tools (the model would choose between free
text and a call: not one grammar), `stream` with a forced tool call (its deltas would be tool_calls fragments),
`response_format` next to a forced tool call, `tools` on /v1/completions (server.py), and any schema
constrained/schema.py does not support.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from .constrained import SchemaError, compile_schema


class StructuredError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Structured:
    schema: dict | bool | None = None    # SamplingParams.json_schema (None: free text)
    tool: str | None = None              # the one forced function: the output is its arguments
    any_tool: bool = False               # tool_choice "required": the output is {"name": ..., "arguments": ...}

    @property
    def is_tool_call(self) -> bool:
        return self.tool is not None or self.any_tool


def structured_output(response_format=None, tools=None, tool_choice=None, stream: bool = False) -> Structured:
    """What a request's structured-output fields ask for. StructuredError (with .param) for what is refused."""
    functions = _functions(tools)
    forced = _tool_choice(tool_choice, functions)
    if forced is not None:
        if response_format not in (None, {"type": "text"}):
            raise StructuredError("response_format cannot be combined with a forced tool call (the answer is the "
                                  "call's arguments)", "response_format")
        if stream:
            raise StructuredError("streaming a tool call is not supported by tinyserve: send stream=false",
                                  "stream")
        return forced
    return Structured(_response_format_schema(response_format))


def _checked(schema, param: str):
    try:
        compile_schema(schema)
    except SchemaError as e:
        raise StructuredError(f"{param}: {e}", param) from None
    return schema


def _response_format_schema(rf):
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise StructuredError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                                  "response_format")
        return _checked(spec["schema"], "response_format")
    raise StructuredError(f"response_format type must be text, json_object or json_schema, got {rf!r}",
                          "response_format")


def _functions(tools) -> dict[str, dict]:
    if tools is None:
        return {}
    if not isinstance(tools, list) or not tools:
        raise StructuredError("tools must be a non-empty list", "tools")
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise StructuredError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                  f"'parameters': {{...}}}}}}", "tools")
        out[fn["name"]] = _checked(fn.get("parameters", {"type": "object", "properties": {}}), "tools")
    return out


# OpenAI's tool_choice words (not to be mistaken for quant modes of the same spelling)
NO_TOOL, MODEL_CHOOSES, SOME_TOOL = "none", "auto", "required"


def _tool_choice(choice, functions: dict[str, dict]) -> Structured | None:
    if choice == NO_TOOL or (choice is None and not functions):
        return None
    if choice in (None, MODEL_CHOOSES):
        raise StructuredError("tool_choice 'auto' (the default with tools) is not supported by tinyserve: name a "
                              "function ({'type': 'function', 'function': {'name': ...}}), or send 'required' or "
                              "'none'", "tool_choice")
    if not functions:
        raise StructuredError("tool_choice given without tools", "tool_choice")
    if choice == SOME_TOOL:
        if len(functions) == 1:
            name, = functions
            return Structured(functions[name], tool=name)
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                  "required": ["name", "arguments"]} for n, p in functions.items()]
        return Structured({"anyOf": calls}, any_tool=True)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name not in functions:
        raise StructuredError(f"tool_choice must be 'none', 'required' or name one of the tools "
                              f"({', '.join(functions)}), got {choice!r}", "tool_choice")
    return Structured(functions[name], tool=name)


def tool_call_message(structured: Structured, text: str) -> dict:
    """The assistant message of a forced tool call whose generated text is `text`."""
    name, arguments = structured.tool, text
    if structured.any_tool:
        try:
            call = json.loads(text)
            name, arguments = call["name"], json.dumps(call["arguments"], ensure_ascii=False)
        except (ValueError, KeyError, TypeError):      # cut off by max_tokens: hand back what there is
            return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": name, "arguments": arguments}}]}
