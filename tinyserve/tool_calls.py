"""Lesson 10: tool calling on a model whose chat template knows no tools — the prompt, the one grammar, the answer.

An agent sends `tools` (functions with JSON-schema parameters) and, usually, no `tool_choice`: OpenAI's default is
then "auto", the model decides between answering and calling. tinyserve makes that decision part of the grammar,
as llama.cpp's generic tool format does for templates without tool support. The model writes one JSON object:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}      a call (or several)
    {"response": "It is sunny in Paris."}                                          an answer

Why one grammar, and not free text with a grammar that starts at a trigger word (llama.cpp's "lazy" grammars for
models trained on tool tokens): a 135M model trained on no tool format rarely writes a trigger on its own, and a
lazy grammar cannot make it; with the choice in the grammar, the first key decides and everything after it is
valid by construction (the arguments match the tool's schema). The cost: a text answer is a JSON string, so the
server unwraps it, also while streaming (`AnswerStream` below decodes the string as it grows).

The agent loop goes through the same text: an assistant message with `tool_calls` is rendered as the object the
model would have written, and a `tool` message as a user turn holding {"tool_response": {...}}. For a template that
does know tools (Tokenizer.template_supports_tools), the template renders the tools and the messages itself.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

MODEL_CHOOSES, SOME_TOOL = "auto", "required"   # tool_choice values: the model decides / it must call
RESPONSE_KEY, CALLS_KEY = "response", "tool_calls"


def tools_prompt(functions: dict[str, dict], descriptions: dict[str, str], mode: str, parallel: bool) -> str:
    """The system-prompt text that shows the model its tools and the answer's form. mode: auto, required, or the
    forced function's name. Under "auto" it carries a worked example of the loop (a call, its result, an answer):
    a small model follows an example far more than a rule (docs/structured-output.md, "auto as one grammar",
    has what SmolLM2 did with each)."""
    listing = "\n".join(json.dumps({"name": n, "description": descriptions.get(n, ""), "parameters": p},
                                   ensure_ascii=False) for n, p in functions.items())
    if mode == MODEL_CHOOSES:
        several = "one or more functions" if parallel else "one function"
        return (f"You are a function-calling assistant. Functions:\n{listing}\nReply in JSON. Call {several} with "
                f'{{"{CALLS_KEY}": [{{"name": ..., "arguments": ...}}]}}; reply in text with '
                f'{{"{RESPONSE_KEY}": "..."}}.\n\nExample:\nUser: Hello!\nAssistant: {{"{RESPONSE_KEY}": "Hello! How can I help?"}}\n'
                f'User: What time is it in Tokyo?\nAssistant: '
                f'{{"{CALLS_KEY}": [{{"name": "get_time", "arguments": {{"city": "Tokyo"}}}}]}}\nUser: '
                f'{tool_result_text("get_time", "10:00", True)}\nAssistant: '
                f'{{"{RESPONSE_KEY}": "It is 10:00 in Tokyo."}}')
    if mode == "required":
        return (f"You are a function-calling assistant. Functions:\n{listing}\nCall one function: reply "
                f'{{"name": ..., "arguments": ...}}.')
    return f"You are a function-calling assistant. Functions:\n{listing}\nCall {mode}: reply with its arguments."


def call_object(name: str, arguments) -> dict:
    return {"name": name, "arguments": arguments}


def auto_schema(functions: dict[str, dict], parallel: bool) -> dict:
    """The one grammar of tool_choice "auto": a call (list) or an answer."""
    calls = {"type": "array", "items": required_schema(functions), "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    return {"anyOf": [
        {"type": "object", "properties": {CALLS_KEY: calls}, "required": [CALLS_KEY]},
        {"type": "object", "properties": {RESPONSE_KEY: {"type": "string"}}, "required": [RESPONSE_KEY]}]}


def required_schema(functions: dict[str, dict]) -> dict:
    """One call of any of the functions: {"name": N, "arguments": <N's parameters>}."""
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p}, "required": ["name", "arguments"]}
             for n, p in functions.items()]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


# --- rendering the conversation (the agent loop) -------------------------------------------------------------------

def render_generic(messages: list[dict], system_extra: str | None, wrap_answers: bool) -> list[dict]:
    """OpenAI messages (dicts: role, content text, tool_calls, tool_call_id) -> role/content messages any chat
    template renders. system_extra (the tools prompt) joins the first system message, or becomes one.
    wrap_answers: earlier assistant answers are shown as {"response": ...}, the form the model writes under "auto"."""
    out: list[dict] = []
    names: dict[str, str] = {}                       # tool_call_id -> function name, for the tool results
    for m in messages:
        role, content = m["role"], m.get("content")
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                names[c["id"]] = c["function"]["name"]
                calls.append(call_object(c["function"]["name"], arguments_value(c["function"]["arguments"])))
            out.append({"role": "assistant", "content": json.dumps({CALLS_KEY: calls}, ensure_ascii=False)})
        elif role == "assistant":
            text = content or ""
            out.append({"role": "assistant", "content": json.dumps({RESPONSE_KEY: text}, ensure_ascii=False)
                        if wrap_answers else text})
        elif role == "tool":
            out.append({"role": "user", "content": tool_result_text(names.get(m["tool_call_id"], ""), content,
                                                                     wrap_answers)})
        else:
            out.append({"role": role, "content": content or ""})
    if system_extra:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system_extra}"}
        else:
            out.insert(0, {"role": "system", "content": system_extra})
    return out


def tool_result_text(name: str, content, ask_for_answer: bool) -> str:
    """A tool's result as the user turn that shows it to the model; under "auto" it also asks for the answer (a
    small model otherwise repeats the call it sees just above)."""
    text = f"The function {name} returned: {json.dumps(content, ensure_ascii=False)}"
    return text + (f'\nReply to my question with {{"{RESPONSE_KEY}": "..."}} using this result.'
                   if ask_for_answer else "")


def arguments_value(arguments: str):
    """A call's arguments as the model would have written them: the parsed JSON, or the string if it is not JSON."""
    try:
        return json.loads(arguments)
    except (TypeError, ValueError, RecursionError):
        return arguments


# --- reading the answer ------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Parsed:
    """What the model wrote, so far or in all: an answer's text, or calls [(name or None, arguments text, done)]."""
    kind: str | None = None                          # "response" | "calls" | None (not decided yet)
    text: str = ""
    calls: list = field(default_factory=list)


def parse(raw: str, mode: str) -> Parsed:
    """The (possibly partial) output of a grammar of `mode`: "auto" (the object above), "required" (one call
    object), or a function name (the arguments alone). Never raises: what is incomplete is left out."""
    if mode not in (MODEL_CHOOSES, SOME_TOOL):
        return Parsed("calls", calls=[(mode, *_value_so_far(raw, 0))])
    if mode == "required":
        call = _call_so_far(raw, 0)
        return Parsed("calls", calls=[call[:3]] if call else [])
    for key, kind in ((RESPONSE_KEY, "response"), (CALLS_KEY, "calls")):
        head = '{"' + key + '": '
        if raw.startswith(head):
            if kind == "response":
                return Parsed(kind, text=_string_so_far(raw, len(head)))
            return Parsed(kind, calls=_calls_so_far(raw, len(head)))
    return Parsed()


def _calls_so_far(raw: str, i: int) -> list:
    calls = []
    if raw[i:i + 1] != "[":
        return calls
    i += 1
    while i < len(raw):
        call = _call_so_far(raw, i)
        if call is None:
            break
        calls.append(call)
        end = call[3]
        if end is None or not raw.startswith(", ", end):
            break
        i = end + 2
    return [c[:3] for c in calls]


def _call_so_far(raw: str, i: int):
    """(name or None, arguments text so far, arguments complete, index after the object or None)."""
    head = '{"name": '
    if not raw.startswith(head, i):
        return None
    try:
        name, j = json.decoder.scanstring(raw, i + len(head) + 1)
    except (ValueError, IndexError):
        return None                                  # the name is not complete yet
    sep = ', "arguments": '
    if not raw.startswith(sep, j):
        return (name, "", False, None)
    args, done = _value_so_far(raw, j + len(sep))
    end = j + len(sep) + len(args)
    return (name, args, done, end + 1 if done and raw.startswith("}", end) else None)


def _value_so_far(raw: str, i: int) -> tuple[str, bool]:
    """The JSON value starting at i: (its text so far, complete?). Scans brackets and strings."""
    depth, j, in_str = 0, i, False
    while j < len(raw):
        c = raw[j]
        if in_str:
            if c == "\\":
                j += 1
            elif c == '"':
                in_str = False
                if depth == 0:
                    return raw[i:j + 1], True
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            if depth == 0:                           # the end of a scalar, closed by the enclosing object
                return raw[i:j], True
            depth -= 1
            if depth == 0:
                return raw[i:j + 1], True
        elif c == "," and depth == 0:
            return raw[i:j], True
        j += 1
    return raw[i:min(j, len(raw))], False


_SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _string_so_far(raw: str, i: int) -> str:
    """The decoded text of the JSON string starting at i (its opening quote), as far as it is complete."""
    if raw[i:i + 1] != '"':
        return ""
    out, j = [], i + 1
    while j < len(raw):
        c = raw[j]
        if c == '"':
            break
        if c != "\\":
            out.append(c)
            j += 1
            continue
        if j + 1 >= len(raw):
            break
        e = raw[j + 1]
        if e != "u":
            out.append(_SIMPLE.get(e, e))
            j += 2
            continue
        hex4 = raw[j + 2:j + 6]
        if len(hex4) < 4:
            break
        cp = int(hex4, 16)
        if 0xD800 <= cp <= 0xDBFF:                   # a surrogate pair: wait for its low half
            low = raw[j + 8:j + 12] if raw.startswith("\\u", j + 6) else ""
            if len(low) < 4:
                break
            cp = 0x10000 + ((cp - 0xD800) << 10) + (int(low, 16) - 0xDC00)
            j += 6
        out.append(chr(cp))
        j += 6
    return "".join(out)


class DeltaStream:
    """The streamed form: the raw output grows, deltas come out in OpenAI's shape. `push(raw_so_far)` returns a
    list of deltas: {"content": piece} for an answer, {"tool_calls": [{"index", "id", "type", "function":
    {"name", "arguments"}}]} for a call's first fragment and {"tool_calls": [{"index", "function": {"arguments":
    piece}}]} for the next ones."""

    def __init__(self, mode: str):
        self.mode = mode
        self.sent_text = 0
        self.sent_args: list[int] = []               # per call: characters of its arguments sent
        self.ids: list[str] = []

    def push(self, raw: str) -> list[dict]:
        p = parse(raw, self.mode)
        out = []
        if p.kind == "response" and len(p.text) > self.sent_text:
            out.append({"content": p.text[self.sent_text:]})
            self.sent_text = len(p.text)
        for i, (name, args, _) in enumerate(p.calls):
            if name is None:
                continue
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(len(args))
                out.append({"tool_calls": [{"index": i, "id": self.ids[i], "type": "function",
                                            "function": {"name": name, "arguments": args}}]})
            elif len(args) > self.sent_args[i]:
                out.append({"tool_calls": [{"index": i, "function": {"arguments": args[self.sent_args[i]:]}}]})
                self.sent_args[i] = len(args)
        return out

    @property
    def called(self) -> bool:
        return bool(self.ids)


def final_message(raw: str, mode: str) -> tuple[dict, bool]:
    """The whole answer's assistant message, and whether it is a tool call. An output cut short (max_tokens) that
    does not parse is handed back as content, as it is."""
    p = parse(raw, mode)
    complete = [(n, a) for n, a, done in p.calls if n is not None and done]
    if p.kind == "calls" and complete:
        return {"role": "assistant", "content": None,
                "tool_calls": [openai_call(n, a) for n, a in complete]}, True
    if p.kind == "response":
        return {"role": "assistant", "content": p.text}, False
    return {"role": "assistant", "content": raw}, False
