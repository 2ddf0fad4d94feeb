"""auto_schema lets any number of calls through: parallel_tool_calls=false is silently ignored."""

CAUGHT_BY = "auto_schema"


def auto_schema(functions, parallel):
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p}, "required": ["name", "arguments"]}
             for n, p in functions.items()]
    return {"anyOf": [
        {"type": "object", "properties": {"tool_calls": {"type": "array", "items": {"anyOf": calls}, "minItems": 1}},
         "required": ["tool_calls"]},
        {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}]}
