"""held_back returns the first stop string's tail and ignores the others: with stops ("END", "STOP"), the text
"... ST" is streamed out although "STOP" may still follow."""
CAUGHT_BY = "held_back"


def held_back(text, stops):
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                return k
        return 0
    return 0
