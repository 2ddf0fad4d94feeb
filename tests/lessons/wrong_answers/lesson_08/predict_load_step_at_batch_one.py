"""predict_load takes the step time at batch 1 and applies Little's law once: it ignores that a larger batch makes
every step slower, so it predicts a smaller batch and lower latencies than the server settles at, and calls rates
stable that the server cannot drain."""
from tinyserve.queueing import LoadPrediction

CAUGHT_BY = "predict_load"


def predict_load(rate, prompt_tokens, output_tokens, step_seconds, prefill_per_token, max_batch=64, iters=200):
    step = step_seconds(1.0)
    ttft = step / 2 + step + prompt_tokens * prefill_per_token
    b = rate * (ttft + (output_tokens - 1) * step)
    if b > max_batch:
        step = step_seconds(max_batch)
        return LoadPrediction(rate, max_batch, step, float("inf"), step, False)
    return LoadPrediction(rate, b, step, ttft, step, True)
