"""sse_event uses json.dumps' default separators (", " and ": "): valid JSON, but not compact: every token's chunk
carries needless bytes, and the frame is not the one the server specifies."""
import json

CAUGHT_BY = "sse_event"


def sse_event(data):
    payload = data if isinstance(data, str) else json.dumps(data)
    if "\n" in payload or "\r" in payload:
        raise ValueError("an SSE data line cannot contain a newline")
    return f"data: {payload}\n\n"
