"""auto_schema as one object with both keys optional: {} and a call-plus-text answer pass too."""

CAUGHT_BY = "auto_schema"


def auto_schema(functions, parallel):
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p}, "required": ["name", "arguments"]}
             for n, p in functions.items()]
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    return {"type": "object", "properties": {"tool_calls": array, "response": {"type": "string"}}}
