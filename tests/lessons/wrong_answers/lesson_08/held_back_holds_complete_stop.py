"""held_back counts a complete stop string too (k up to len(s) instead of len(s) - 1): the stream would hold back
text the caller is about to cut anyway, and "the END" reports 3 instead of 0."""
CAUGHT_BY = "held_back"


def held_back(text, stops):
    best = 0
    for s in stops:
        for k in range(min(len(s), len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
