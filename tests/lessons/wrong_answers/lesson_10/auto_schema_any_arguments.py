"""auto_schema checks the name but lets any object be the arguments: get_time gets get_weather's arguments."""

CAUGHT_BY = "auto_schema"


def auto_schema(functions, parallel):
    call = {"type": "object", "properties": {"name": {"enum": list(functions)}, "arguments": {"type": "object"}},
            "required": ["name", "arguments"]}
    array = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    return {"anyOf": [{"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"]},
                      {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}]}
