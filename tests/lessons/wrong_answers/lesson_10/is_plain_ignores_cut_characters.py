"""is_plain decodes with errors="ignore": a token holding half of 'é' counts as plain (it would leave the string
body in the middle of a character)."""

CAUGHT_BY = "is_plain"


def is_plain(data):
    text = data.decode("utf-8", errors="ignore")
    return not any(c in '"\\\x7f' or c < " " for c in text)
