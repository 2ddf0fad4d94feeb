"""generate makes a new rng from the seed for every token, so a seeded request repeats the same draw."""
from tinyserve.kv_cache import KVCache, forward_with_cache, prefill
from tinyserve.kv_sizing import max_kv_positions
from tinyserve.sampling import SamplingParams, sample
from tinyserve.stopping import start_request

CAUGHT_BY = "generate"


def generate(model, ids, max_new_tokens=None, params=None, tokenizer=None):
    params = params or SamplingParams()
    tokens, stopper, rng = start_request(model.config, ids, max_new_tokens, params, tokenizer)
    cache = KVCache.allocate(model.config, max_kv_positions(len(tokens), stopper.max_new_tokens,
                                                            model.config.max_seq_len))
    logits = prefill(model, cache, tokens)
    seq, out = list(tokens), []
    while True:
        tok = sample(logits, params, params.make_rng(), seen=seq)
        out.append(tok)
        seq.append(tok)
        if stopper.should_stop(out):
            return out
        logits = forward_with_cache(model, cache, [tok])[0]
