"""is_plain takes the control characters as those below 0x1f instead of 0x20: U+001F (the unit separator) slips
through, and a raw one makes the JSON invalid."""
CAUGHT_BY = "is_plain"


def is_plain(data):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return not any(c in '"\\\x7f' or c < "\x1f" for c in text)
