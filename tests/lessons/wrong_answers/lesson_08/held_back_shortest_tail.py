"""held_back returns the shortest tail that starts a stop string instead of the longest: "aa" with stop "aaa"
holds back one character and streams out an "a" that may belong to the stop."""
CAUGHT_BY = "held_back"


def held_back(text, stops):
    best = 0
    for s in stops:
        for k in range(1, min(len(s) - 1, len(text)) + 1):
            if text.endswith(s[:k]):
                best = k if best == 0 else min(best, k)
                break
    return best
