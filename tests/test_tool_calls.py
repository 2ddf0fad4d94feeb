"""tool_calls.py on its own: reading a (partial) answer, the streamed deltas, the agent loop's rendering, and the
tool-aware template path (a fake tokenizer standing in for a GGUF template that supports tools)."""
from __future__ import annotations

import json

import pytest

from tinyserve import tool_calls
from tinyserve.constrained import Automaton, compile_schema, dumps
from tinyserve.protocol import ChatCompletionRequest
from tinyserve.server import OpenAIService
from tinyserve.structured_api import structured_output

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def chunks(text: str, size: int):
    return [text[:i] for i in range(1, len(text) + 1, size)] + [text]


@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize("value", [
    {"response": "It is \"sunny\" in Zo\u00e9's town \U0001F600\n"},
    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]},
    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "a}b]\"c"}},
                    {"name": "get_weather", "arguments": {"city": "Rome"}}]},
])
def test_streamed_deltas_add_up_to_the_whole_answer(value, size):
    raw = dumps(value)
    assert Automaton(compile_schema(tool_calls.auto_schema({"get_weather": WEATHER}, True))).matches(raw.encode())
    stream, text, calls = tool_calls.DeltaStream("auto"), "", {}
    for prefix in chunks(raw, size):
        for d in stream.push(prefix):
            text += d.get("content", "")
            for tc in d.get("tool_calls", []):
                entry = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
                if "id" in tc:
                    assert entry["name"] is None and tc["function"]["name"] == "get_weather"
                    entry["name"] = tc["function"]["name"]
                entry["arguments"] += tc["function"]["arguments"]
    message, called = tool_calls.final_message(raw, "auto")
    if "response" in value:
        assert not called and text == value["response"] == message["content"] and not calls
    else:
        assert called and not text
        got = [json.loads(calls[i]["arguments"]) for i in sorted(calls)]
        assert got == [c["arguments"] for c in value["tool_calls"]]
        assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == got


def test_a_partial_answer_is_never_misread():
    assert tool_calls.parse('{"respo', "auto").kind is None
    assert tool_calls.parse('{"response": "ab\\u00', "auto").text == "ab"          # an escape not complete yet
    assert tool_calls.parse('{"response": "\\ud83d\\ude00', "auto").text == "\U0001F600"
    assert tool_calls.parse('{"response": "\\ud83d', "auto").text == ""             # half a surrogate pair
    p = tool_calls.parse('{"tool_calls": [{"name": "get_wea', "auto")
    assert p.kind == "calls" and p.calls == []                                      # the name is not complete
    p = tool_calls.parse('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa', "auto")
    assert p.calls == [("get_weather", '{"city": "Pa', False)]
    # cut by max_tokens: handed back as content, not a broken call
    message, called = tool_calls.final_message('{"tool_calls": [{"name": "get_weather", "arguments": {"ci', "auto")
    assert not called and message["content"].startswith('{"tool_calls"')


def test_forced_modes_read_their_own_forms():
    args = '{"city": "Oslo"}'
    message, called = tool_calls.final_message(args, "get_weather")
    assert called and message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": args}
    message, called = tool_calls.final_message('{"name": "get_weather", "arguments": ' + args + "}", "required")
    assert called and message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": args}


def test_the_agent_loop_renders_calls_and_results():
    call = {"id": "c7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c7", "content": "-3 C"},
            {"role": "assistant", "content": "Cold."}]
    out = tool_calls.render_generic(msgs, "TOOLS", wrap_answers=True)
    assert out[0] == {"role": "system", "content": "Be brief.\n\nTOOLS"}
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
    assert out[3]["role"] == "user" and "get_weather" in out[3]["content"] and "-3 C" in out[3]["content"]
    assert json.loads(out[4]["content"]) == {"response": "Cold."}


class ToolTemplateTokenizer:
    """A tokenizer whose chat template knows tools (what `tok` adds for GGUF templates): it records its call."""
    template_supports_tools = True

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
        self.calls.append((messages, add_generation_prompt, tools))
        return "x" * 10

    def encode(self, text):
        return [1] * len(text)


def test_a_template_that_knows_tools_renders_them_itself():
    tok = ToolTemplateTokenizer()
    service = OpenAIService.__new__(OpenAIService)
    service.tokenizer, service.max_prompt_chars = tok, None
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "tools": TOOLS})
    service.chat_ids(body, structured_output(tools=TOOLS))
    messages, gen, tools = tok.calls[-1]
    assert gen is True and tools[0]["function"]["name"] == "get_weather"
    assert messages[-2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}   # parsed, as HF templates want
    assert messages[-1] == {"role": "tool", "content": "ok", "tool_call_id": "c1"}
