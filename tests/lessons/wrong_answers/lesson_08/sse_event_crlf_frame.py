"""sse_event ends the frame with CRLF CRLF, HTTP headers' line ending: legal SSE, but not the frame the course's
server and its tests specify ("data: <payload>\n\n"), and its "\r" survives a client that splits on "\n" only."""
import json

CAUGHT_BY = "sse_event"


def sse_event(data):
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    if "\n" in payload or "\r" in payload:
        raise ValueError("an SSE data line cannot contain a newline")
    return f"data: {payload}\r\n\r\n"
