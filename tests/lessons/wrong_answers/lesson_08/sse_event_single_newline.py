"""sse_event ends the frame with one newline: without the blank line the client never sees the event end, and the
next frame's data joins this one."""
import json

CAUGHT_BY = "sse_event"


def sse_event(data):
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    if "\n" in payload or "\r" in payload:
        raise ValueError("an SSE data line cannot contain a newline")
    return f"data: {payload}\n"
