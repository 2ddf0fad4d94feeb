"""sse_event splits a raw payload with newlines into several data: lines instead of refusing it: legal SSE (the
client joins them with "\n"), but the OpenAI stream's parser reads each data line as one JSON document."""
import json

CAUGHT_BY = "sse_event"


def sse_event(data):
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return "".join(f"data: {line}\n" for line in payload.splitlines() or [""]) + "\n"
