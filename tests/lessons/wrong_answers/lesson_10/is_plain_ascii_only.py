"""is_plain looks only for a quote or a backslash: half a UTF-8 character and raw control characters pass."""

CAUGHT_BY = "is_plain"


def is_plain(data):
    return b'"' not in data and b"\\" not in data
