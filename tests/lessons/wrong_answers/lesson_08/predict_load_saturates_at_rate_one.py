"""predict_load calls the server saturated when the batch the law asks for exceeds max_batch only at the end of the
iteration, and reports the step at the last guess instead of at max_batch."""
from tinyserve.queueing import LoadPrediction

CAUGHT_BY = "predict_load"


def predict_load(rate, prompt_tokens, output_tokens, step_seconds, prefill_per_token, max_batch=64, iters=200):
    b = 1.0
    for _ in range(iters):
        step = step_seconds(b)
        w = 1.5 * step + prompt_tokens * prefill_per_token + (output_tokens - 1) * step
        nb = max(rate * w, 1e-9)
        if abs(nb - b) < 1e-6:
            break
        b = min(0.5 * (b + nb), 1e6)
    step = step_seconds(b)
    if b > max_batch:
        return LoadPrediction(rate, max_batch, step, float("inf"), step, False)
    return LoadPrediction(rate, b, step, 1.5 * step + prompt_tokens * prefill_per_token, step, True)
