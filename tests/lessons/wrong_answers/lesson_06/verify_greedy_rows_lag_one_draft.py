"""verify_greedy lets row i see only draft[:i - 1]: the token accepted just before it is not yet in the penalty's context."""
from tinyserve.sampling import sample
from tinyserve.speculative import _check_rows

CAUGHT_BY = "verify_greedy"


def verify_greedy(logits, draft, params, seen=()):
    _check_rows(logits, draft)
    if not params.greedy:
        raise ValueError("verify_greedy needs greedy params")
    out = []
    for i in range(len(draft) + 1):
        tok = sample(logits[i], params, None, seen=list(seen) + list(draft[:max(0, i - 1)]))
        out.append(tok)
        if i == len(draft) or tok != draft[i]:
            return out
