"""sse_event JSON-encodes every payload, strings included: the end marker goes out as "[DONE]" in quotes, which
the OpenAI client does not recognise as the end of the stream."""
import json

CAUGHT_BY = "sse_event"


def sse_event(data):
    payload = json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"
