"""is_plain counts the space (0x20) among the control characters (c <= " "): every token with a space, the most
common tokens inside a string, is then walked needlessly (and " the" reported not plain)."""
CAUGHT_BY = "is_plain"


def is_plain(data):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return not any(c in '"\\\x7f' or c <= " " for c in text)
