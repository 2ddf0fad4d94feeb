"""verify_stochastic draws the replacement for a rejected token from p instead of the residual max(0, p - q): the
tokens the drafter over-proposes get their probability twice, so the output no longer follows the target."""
import numpy as np

from tinyserve.drafters import draw
from tinyserve.sampling import probabilities
from tinyserve.speculative import _check_rows, _seen

CAUGHT_BY = "verify_stochastic"


def verify_stochastic(logits, draft, draft_probs, params, rng, seen=()):
    _check_rows(logits, draft)
    k, V = len(draft), logits.shape[1]
    if draft_probs is not None and draft_probs.shape != (k, V):
        raise ValueError("draft_probs must be [k, V]")
    ctx = _seen(seen, params)
    out = []
    for i, x in enumerate(draft):
        p = probabilities(logits[i], params, ctx)
        q = np.zeros(V) if draft_probs is None else draft_probs[i]
        if draft_probs is None:
            q[x] = 1.0
        if rng.random() * q[x] < p[x]:
            out.append(int(x))
            if ctx != ():
                ctx.append(int(x))
            continue
        out.append(draw(p, rng))
        return out
    out.append(draw(probabilities(logits[k], params, ctx), rng))
    return out
