"""predict_load's TTFT forgets the half step a request waits, on average, for the next step boundary (TTFT =
t_step + prefill): its batch and TTFT come out low by half a step."""
from tinyserve.queueing import LoadPrediction

CAUGHT_BY = "predict_load"


def predict_load(rate, prompt_tokens, output_tokens, step_seconds, prefill_per_token, max_batch=64, iters=200):
    b = 1.0
    for _ in range(iters):
        step = step_seconds(b)
        w = step + prompt_tokens * prefill_per_token + (output_tokens - 1) * step
        nb = max(rate * w, 1e-9)
        if nb > max_batch:
            step = step_seconds(max_batch)
            return LoadPrediction(rate, max_batch, step, float("inf"), step, False)
        if abs(nb - b) < 1e-6:
            break
        b = 0.5 * (b + nb)
    step = step_seconds(b)
    return LoadPrediction(rate, b, step, step + prompt_tokens * prefill_per_token, step, True)
