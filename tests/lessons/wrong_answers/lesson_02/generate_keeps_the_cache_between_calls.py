"""generate keeps one module-level cache across calls and never resets it (state carried between requests)."""
from tinyserve.kv_cache import KVCache, forward_with_cache, prefill
from tinyserve.kv_sizing import max_kv_positions
from tinyserve.sampling import SamplingParams, sample
from tinyserve.stopping import start_request

CAUGHT_BY = "generate"
_CACHE = None


def generate(model, ids, max_new_tokens=None, params=None, tokenizer=None):
    params = params or SamplingParams()
    tokens, stopper, rng = start_request(model.config, ids, max_new_tokens, params, tokenizer)
    global _CACHE
    if _CACHE is None:
        _CACHE = KVCache.allocate(model.config)
    cache = _CACHE
    logits = prefill(model, cache, tokens)
    seq, out = list(tokens), []
    while True:
        tok = sample(logits, params, rng, seen=seq)
        out.append(tok)
        seq.append(tok)
        if stopper.should_stop(out):
            return out
        logits = forward_with_cache(model, cache, [tok])[0]
