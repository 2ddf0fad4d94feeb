"""is_plain rejects only the control characters JSON has short escapes for (\b \f \n \r \t): a raw \x01 or \x1f is
as invalid inside a JSON string, but this lets such a token skip the walk."""
CAUGHT_BY = "is_plain"


def is_plain(data):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return not any(c in '"\\\x7f\b\f\n\r\t' for c in text)
