"""sse_event refuses a payload with a line feed but lets a carriage return through: SSE ends a line at CR, LF or
CRLF, so a raw "\r" splits the data line and the client parses half a payload."""
import json

CAUGHT_BY = "sse_event"


def sse_event(data):
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    if "\n" in payload:
        raise ValueError("an SSE data line cannot contain a newline")
    return f"data: {payload}\n\n"
