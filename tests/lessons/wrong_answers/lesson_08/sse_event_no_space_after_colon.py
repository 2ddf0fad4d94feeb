"""sse_event writes "data:<payload>" without the space: a client that strips exactly "data: " (six characters, as
many hand-written ones do) loses the payload's first character."""
import json

CAUGHT_BY = "sse_event"


def sse_event(data):
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    if "\n" in payload or "\r" in payload:
        raise ValueError("an SSE data line cannot contain a newline")
    return f"data:{payload}\n\n"
