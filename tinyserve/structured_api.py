"""Structured output on the OpenAI wire: `response_format`, `tools`, `tool_choice` and `parallel_tool_calls` -> one
JSON schema for the Engine (SamplingParams.json_schema) and how to read the answer. Pure: no engine, no network.

  response_format {"type": "text"}                          free text
  response_format {"type": "json_object"}                   any JSON object
  response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                            JSON valid under `schema` (always enforced, strict or not)
  tools (+ tool_choice "auto", OpenAI's default with tools) the model chooses: one grammar whose answer is either
                                                            {"tool_calls": [...]} or {"response": "..."}
                                                            (tool_calls.py says why); the answer is a `tool_calls`
                                                            message (finish_reason "tool_calls") or plain content
  tools + tool_choice {"type": "function", "function": {"name": N}}
                                                            the arguments of N (its `parameters` schema)
  tools + tool_choice "required"                            one call of any listed function: the model writes
                                                            {"name": N, "arguments": {...}} under an anyOf of the tools
  tools + tool_choice "none"                                the tools are not shown to the model, no call is made
  parallel_tool_calls                                       honoured under "auto" (false: at most one call); a forced
                                                            choice is always one call

Every mode streams: the answer's text as `content` deltas, a call as `tool_calls` deltas (tool_calls.DeltaStream).
Refused (400, naming the parameter): `response_format` next to tools that may be called (the answer's form is
the tools'), `tools` on /v1/completions (server.py), malformed tools or tool_choice, and any schema
constrained/schema.py does not support or that is over its budget.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from . import tool_calls
from .constrained import SchemaError, compile_schema


class StructuredError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Structured:
    schema: dict | bool | None = None    # SamplingParams.json_schema (None: free text)
    mode: str | None = None              # None (no tool call possible), "auto", "required", or the forced function
    functions: tuple = ()                # ((name, parameters, description), ...) shown to the model
    parallel: bool = True

    @property
    def tools_active(self) -> bool:
        return self.mode is not None

    @property
    def tool(self) -> str | None:        # the one forced function
        return self.mode if self.mode not in (None, MODEL_CHOOSES, SOME_TOOL) else None


# OpenAI's tool_choice words (not to be mistaken for quant modes of the same spelling)
NO_TOOL = "none"
MODEL_CHOOSES, SOME_TOOL = tool_calls.MODEL_CHOOSES, tool_calls.SOME_TOOL


def structured_output(response_format=None, tools=None, tool_choice=None, stream: bool = False,
                      parallel_tool_calls=None) -> Structured:
    """What a request's structured-output fields ask for. StructuredError (with .param) for what is refused."""
    functions = _functions(tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise StructuredError(f"parallel_tool_calls must be true or false, got {_short(parallel_tool_calls)}",
                              "parallel_tool_calls")
    mode = _tool_choice(tool_choice, functions)
    if mode is None:
        return Structured(_response_format_schema(response_format))
    if response_format not in (None, {"type": "text"}):
        raise StructuredError("response_format cannot be combined with tools that may be called (the answer's form "
                              "is the tools'): send tool_choice 'none' or drop response_format", "response_format")
    params = {n: p for n, (p, _) in functions.items()}
    if mode == MODEL_CHOOSES:
        schema = tool_calls.auto_schema(params, parallel_tool_calls is not False)
    elif mode == SOME_TOOL:
        schema = tool_calls.required_schema(params)
    else:
        schema = params[mode]
    shown = tuple((n, p, d) for n, (p, d) in functions.items())
    return Structured(schema, mode, shown, parallel_tool_calls is not False)


def _short(value, limit: int = 80) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else text[:limit] + "..."


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
    raise StructuredError(f"response_format type must be text, json_object or json_schema, got {_short(rf)}",
                          "response_format")


MAX_TOOLS = 128


def _functions(tools) -> dict[str, tuple]:
    """name -> (parameters schema, description)."""
    if tools is None:
        return {}
    if not isinstance(tools, list) or not tools:
        raise StructuredError("tools must be a non-empty list", "tools")
    if len(tools) > MAX_TOOLS:
        raise StructuredError(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise StructuredError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                  f"'parameters': {{...}}}}}}", "tools")
        if fn["name"] in out:
            raise StructuredError(f"tools[{i}]: the name {fn['name']!r} is given twice", "tools")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise StructuredError(f"tools[{i}].function.description must be a string", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        out[fn["name"]] = (_checked(params, "tools"), description)
    return out


def _tool_choice(choice, functions: dict) -> str | None:
    """The mode: None (no call possible), "auto", "required", or the name of the forced function."""
    if choice == NO_TOOL or (choice is None and not functions):
        return None
    if not functions:
        raise StructuredError("tool_choice given without tools", "tool_choice")
    if choice in (None, MODEL_CHOOSES, SOME_TOOL):
        return choice or MODEL_CHOOSES
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or name not in functions:
        raise StructuredError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', "
                              f"'function': {{'name': N}}}} naming one of the tools ({', '.join(list(functions)[:8])}), "
                              f"got {_short(choice)}", "tool_choice")
    return name

