"""Structured output through the OpenAI-compatible server, with the real `openai` client: response_format
json_object / json_schema, forced tool calls, and clear 400s for what is refused. The tiny model (random, a
character tokenizer) answers noise, but noise that parses and validates; the real model runs 20 schemas."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

import tinyserve as ts
from tinyserve.engine import Engine
from tinyserve.sampling import SamplingParams
from tinyserve.server import CharTokenizer, ServerThread, create_app
from tinyserve.structured_api import StructuredError, structured_output

TOK = CharTokenizer()
PERSON = {"type": "object", "properties": {"name": {"enum": ["Ann", "Bob"]}, "age": {"type": "integer"},
                                           "ok": {"type": "boolean"}}, "required": ["name", "ok"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
DEEP = {"type": "integer"}
for _ in range(400):                              # 16 KB nesting objects 400 deep: once a RecursionError (500)
    DEEP = {"type": "object", "properties": {"a": DEEP}}
AMBIGUOUS = {"type": "integer"}
for k in range(12):                               # anyOf of arrays 12 deep: once seconds of compile per request
    AMBIGUOUS = {"anyOf": [{"type": "array", "items": AMBIGUOUS}, {"type": "array", "items": AMBIGUOUS,
                                                                     "minItems": 1}]}


@pytest.fixture(scope="module")
def srv():
    engine = Engine(ts.tiny_model(seed=0), num_blocks=128, block_size=16, tokenizer=TOK, prefix_caching=True)
    with ServerThread(create_app(engine, TOK, "tiny")) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=kw.pop("max_tokens", 200), **kw)


def test_json_schema_answers_validate_streamed_or_not(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(4):
        r = chat(client, response_format=rf, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, response_format=rf, temperature=0,
                                                                       stream=True))
    assert streamed == chat(client, response_format=rf, temperature=0).choices[0].message.content


def test_json_object_is_an_object(client):
    r = chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=400)
    if r.choices[0].finish_reason == "stop":       # a random model may still be inside a long string at 400
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].message.content.startswith("{")


def test_a_named_tool_is_called_with_valid_arguments(client):
    r = chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
             temperature=0)
    call, = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_picks_one_of_the_tools(client):
    names = set()
    for seed in range(6):
        r = chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=seed)
        call, = r.choices[0].message.tool_calls
        fn = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
        jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
        names.add(call.function.name)
    assert names                                   # (which tool a random model picks is its business)


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": "get_weather"}), "tool_choice"),
    (dict(tools=[WEATHER], response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls"),
    (dict(tools=[WEATHER, WEATHER]), "tools"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"oneOf": []}}}),
     "response_format"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/x"}}}],
          tool_choice="required"), "tools"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}),
     "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": AMBIGUOUS}}),
     "response_format"),
])
def test_what_is_refused_gets_a_400_naming_the_parameter(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        r = chat(client, **kw)
        if kw.get("stream"):
            list(r)
    assert e.value.body["param"] == param, e.value.body


@pytest.fixture(scope="module")
def long_client():
    """The tiny model with a context of 2048 (the tools prompt alone is ~900 characters, a token each here)."""
    engine = Engine(ts.tiny_model(seed=0, max_seq_len=2048), num_blocks=256, block_size=16, tokenizer=TOK,
                    prefix_caching=True)
    with ServerThread(create_app(engine, TOK, "tiny")) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_auto_answers_a_call_or_text_streamed_or_not_and_the_agent_loop_renders(long_client):
    """tool_choice "auto" (OpenAI's default with tools): the tiny random model writes either form; whichever it is,
    the message is a valid call or plain text, and streaming gives the same answer in OpenAI's delta shape."""
    client = long_client
    kinds = set()
    for seed in range(6):
        kw = dict(tools=[WEATHER, TIME], temperature=1.0, seed=seed, max_tokens=400)
        r = chat(client, **kw)
        msg, reason = r.choices[0].message, r.choices[0].finish_reason
        streamed_text, calls = "", {}
        for c in chat(client, stream=True, **kw):
            d = c.choices[0].delta if c.choices else None
            if d is not None and d.content:
                streamed_text += d.content
            for tc in (d.tool_calls or []) if d is not None else []:
                entry = calls.setdefault(tc.index, {"name": None, "arguments": ""})
                if tc.function.name:
                    assert tc.id and entry["name"] is None, "the name comes once, with the call's id"
                    entry["name"] = tc.function.name
                entry["arguments"] += tc.function.arguments or ""
            if c.choices and c.choices[0].finish_reason:
                assert c.choices[0].finish_reason == reason
        if reason == "tool_calls":
            kinds.add("call")
            assert msg.tool_calls and msg.content is None
            for call in msg.tool_calls:
                fn = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
                jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
            assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
                [(c.function.name, c.function.arguments) for c in msg.tool_calls]
        elif reason == "stop":
            kinds.add("text")
            assert streamed_text == msg.content and not calls and not msg.tool_calls
    assert kinds, "no seed finished within max_tokens"
    # the loop: the call and its result reach the prompt (more prompt tokens than the question alone)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "C"}'}}
    loop = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22"}]
    base = client.chat.completions.create(model="tiny", messages=loop[:1], max_tokens=1).usage.prompt_tokens
    with_tools = client.chat.completions.create(model="tiny", messages=loop[:1], max_tokens=1, tools=[WEATHER],
                                                tool_choice="none").usage.prompt_tokens
    assert with_tools == base, "tool_choice none: the tools are not shown"
    shown = client.chat.completions.create(model="tiny", messages=loop[:1], max_tokens=1, tools=[WEATHER],
                                           tool_choice="auto").usage.prompt_tokens
    assert shown > base + 50, "the tool definitions must reach the prompt"
    looped = client.chat.completions.create(model="tiny", messages=loop, max_tokens=1, tools=[WEATHER],
                                            tool_choice="none").usage.prompt_tokens
    assert looped > base + 40, "the assistant's call and the tool's result must reach the prompt"


def test_completions_take_response_format_but_not_tools(client):
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=5,
                                  extra_body={"tools": [WEATHER], "tool_choice": "required"})
    assert e.value.body["param"] == "tools"


def test_structured_output_reduction():
    assert structured_output().schema is None and structured_output({"type": "text"}).schema is None
    assert structured_output({"type": "json_object"}).schema == {"type": "object"}
    named = structured_output(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tool == "get_weather" and named.schema == WEATHER["function"]["parameters"]
    one = structured_output(tools=[WEATHER], tool_choice="required")
    assert one.mode == "required" and one.schema["properties"]["name"] == {"const": "get_weather"}
    auto = structured_output(tools=[WEATHER, TIME])
    assert auto.mode == "auto" and [set(o["properties"]) for o in auto.schema["anyOf"]] == [{"tool_calls"},
                                                                                           {"response"}]
    assert "maxItems" not in auto.schema["anyOf"][0]["properties"]["tool_calls"]
    single = structured_output(tools=[WEATHER], parallel_tool_calls=False)
    assert single.schema["anyOf"][0]["properties"]["tool_calls"]["maxItems"] == 1
    assert structured_output(tools=[WEATHER], tool_choice="none").schema is None
    with pytest.raises(StructuredError, match="without tools"):
        structured_output(tool_choice="required")


# --- the real model: 20 schemas, every answer parses and validates, the same alone or all at once -----------------

REAL_SCHEMAS = [
    {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]},
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3},
    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                      "population": {"type": "integer"}}, "required": ["city", "country"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                      "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
     "required": ["title", "year", "genres"]},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                      "confidence": {"type": "number"}}, "required": ["sentiment", "confidence"]},
    {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
     "required": ["steps"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "admin": {"type": "boolean"}}, "required": ["id", "admin"]}},
     "required": ["user"]},
    {"type": "object", "properties": {"value": {"type": ["integer", "null"]}}, "required": ["value"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "coords": {"type": "array",
                                                                            "items": {"type": "number"},
                                                                            "minItems": 2, "maxItems": 2}},
     "required": ["kind", "coords"]},
    {"type": "object", "properties": {"language": {"enum": ["Python", "Rust", "Go"]},
                                      "typed": {"type": "boolean"}}, "required": ["language", "typed"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                      "sum": {"type": "integer"}}, "required": ["a", "b", "sum"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "string"}}, "required": ["ok"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["name", "qty"]}, "maxItems": 2}},
     "required": ["items"]},
    {"anyOf": [{"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]},
               {"type": "object", "properties": {"no": {"type": "boolean"}}, "required": ["no"]}]},
    {"type": "integer"},
]
REAL_PROMPTS = ["What is the capital of France?", "Describe a person named Alice who is 30.", "Is the sky blue?",
                "Name a primary color.", "Give a point in the plane.", "List three small numbers.",
                "List some fruits.", "Describe Paris.", "Describe the movie Alien.", "I love this product!",
                "How do I boil an egg?", "Describe user 7, an admin.", "What is 2 + 2?", "Give a 2D point.",
                "Which language is known for memory safety?", "Add 2 and 3.", "Is water wet?",
                "A shopping list with apples.", "Do cats bark?", "How many legs does a spider have?"]


@pytest.fixture(scope="module")
def smol_srv(smol, smol_tok):
    engine = Engine(smol, num_blocks=256, block_size=16, max_batch_tokens=256, tokenizer=smol_tok,
                    prefix_caching=True)
    with ServerThread(create_app(engine, smol_tok, "smol")) as s:
        yield s


@pytest.mark.real
@pytest.mark.slow
def test_real_model_20_schemas_validate_and_do_not_depend_on_the_batch(smol_srv):
    client = openai.OpenAI(base_url=smol_srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def ask(i):
        r = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": REAL_PROMPTS[i]}], temperature=0, max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": REAL_SCHEMAS[i],
                                                                     "strict": True}})
        return r.choices[0].message.content, r.choices[0].finish_reason

    alone = [ask(i) for i in range(len(REAL_SCHEMAS))]                   # B = 1
    with ThreadPoolExecutor(len(REAL_SCHEMAS)) as pool:                  # all 20 in flight together
        together = list(pool.map(ask, range(len(REAL_SCHEMAS))))
    for (text, reason), schema in zip(alone, REAL_SCHEMAS):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert together == alone


# --- the command line ---------------------------------------------------------------------------------------------

def test_generate_json_schema_and_json_object(tmp_path, capsys):
    from tinyserve.__main__ import main
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(PERSON))
    assert main(["generate", "--model", "tiny", "--json-schema", str(schema), "--max-new-tokens", "60", "hi"]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), PERSON)
    assert main(["generate", "--model", "tiny", "--json-object", "--max-new-tokens", "300", "hi"]) == 0
    assert capsys.readouterr().out.startswith("{")


@pytest.mark.parametrize("args, words", [(["--json-schema", "/nonexistent.json"], ["cannot read"]),
                                         (["--json-object", "--strategy", "kv"], ["--strategy paged"])])
def test_generate_structured_errors_exit_2(capsys, args, words):
    from tinyserve.__main__ import main
    assert main(["generate", "--model", "tiny", *args, "hi"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words) and "Traceback" not in err


# --- the real model with the real SDK: an agent loop, and parse() with what pydantic emits -----------------------

GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _streamed(stream) -> tuple[str, list[dict], str]:
    """(content, calls [{id, name, arguments}], finish_reason) put together from a chat stream's deltas."""
    text, calls, reason = "", {}, None
    for c in stream:
        if not c.choices:
            continue
        d = c.choices[0].delta
        text += d.content or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
            entry["arguments"] += tc.function.arguments or ""
        reason = c.choices[0].finish_reason or reason
    return text, [calls[i] for i in sorted(calls)], reason


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_real_model_agent_loop_of_three_turns(smol_srv, stream):
    """tools without tool_choice -> a call -> the tool's result -> a text answer, as an agent framework runs it."""
    client = openai.OpenAI(base_url=smol_srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    def turn():
        kw = dict(model="smol", messages=messages, tools=[GET_WEATHER], temperature=0, max_tokens=60)
        if not stream:
            r = client.chat.completions.create(**kw)
            m = r.choices[0].message
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in m.tool_calls or []]
            return m.content, calls, r.choices[0].finish_reason
        return _streamed(client.chat.completions.create(stream=True, **kw))

    content, calls, reason = turn()
    assert reason == "tool_calls" and content in (None, ""), (content, reason)
    call, = calls
    assert call["name"] == "get_weather" and call["id"]
    assert "city" in json.loads(call["arguments"])
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]})
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 22 degrees Celsius"})
    content, calls, reason = turn()
    assert reason == "stop" and not calls and content, (content, calls, reason)
    assert "22" in content, content


@pytest.mark.real
@pytest.mark.slow
def test_real_model_sdk_parse_with_nested_models_enums_lists_and_bounds(smol_srv):
    """client.chat.completions.parse with what pydantic emits ($defs/$ref for the nested model and the Enum,
    maxLength, minimum/maximum, maxItems): 10 seeds, every answer parses into the model (the SDK validates it)."""
    import enum

    from pydantic import BaseModel, Field

    class Size(str, enum.Enum):
        small = "small"
        large = "large"

    class Item(BaseModel):
        name: str = Field(max_length=12)
        quantity: int = Field(ge=1, le=9)
        size: Size

    class Order(BaseModel):
        customer: str = Field(max_length=20)
        items: list[Item] = Field(max_length=3)
        rating: int = Field(ge=0, le=10)

    client = openai.OpenAI(base_url=smol_srv.url + "/v1", api_key="unused", max_retries=0, timeout=900)

    def ask(seed):
        r = client.chat.completions.parse(
            model="smol", response_format=Order, temperature=0.8, seed=seed, max_tokens=160,
            messages=[{"role": "user", "content": "Anna orders two large pizzas and one small salad. Write the order."}])
        return r.choices[0].finish_reason, r.choices[0].message.parsed

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(ask, range(10)))
    for reason, order in answers:
        assert reason == "stop" and isinstance(order, Order)
        assert len(order.customer) <= 20 and 0 <= order.rating <= 10 and len(order.items) <= 3
        assert all(isinstance(i.size, Size) and 1 <= i.quantity <= 9 for i in order.items)
