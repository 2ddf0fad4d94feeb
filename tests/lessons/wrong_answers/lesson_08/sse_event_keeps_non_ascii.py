"""sse_event sends non-ASCII raw (ensure_ascii=False): a U+2028 in a token's text then breaks the event for every
client that splits its lines with str.splitlines()."""
import json

CAUGHT_BY = "sse_event"


def sse_event(data):
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    if "\n" in payload or "\r" in payload:
        raise ValueError("an SSE data line cannot contain a newline")
    return f"data: {payload}\n\n"
