"""verify_greedy stops after the k drafted tokens when all of them agree: the bonus token of row k, which the
verify forward computed for free, is thrown away (and an empty draft returns nothing at all)."""
from tinyserve.speculative import _check_rows, _seen
from tinyserve.sampling import sample

CAUGHT_BY = "verify_greedy"


def verify_greedy(logits, draft, params, seen=()):
    _check_rows(logits, draft)
    if not params.greedy:
        raise ValueError("verify_greedy needs greedy params")
    ctx = _seen(seen, params)
    out = []
    for i in range(len(draft)):
        tok = sample(logits[i], params, None, seen=ctx)
        out.append(tok)
        if tok != draft[i]:
            return out
        if ctx != ():
            ctx.append(tok)
    return out
