"""verify_greedy gives every row's repetition penalty the whole draft (seen + draft), also the tokens after the row."""
from tinyserve.sampling import sample
from tinyserve.speculative import _check_rows

CAUGHT_BY = "verify_greedy"


def verify_greedy(logits, draft, params, seen=()):
    _check_rows(logits, draft)
    if not params.greedy:
        raise ValueError("verify_greedy needs greedy params")
    ctx = list(seen) + list(draft)
    out = []
    for i in range(len(draft) + 1):
        tok = sample(logits[i], params, None, seen=ctx)
        out.append(tok)
        if i == len(draft) or tok != draft[i]:
            return out
