"""generate stops on EOS but leaves the EOS token out of its output."""
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
        tok = sample(logits, params, rng, seen=seq)
        out.append(tok)
        seq.append(tok)
        if stopper.should_stop(out):
            return out[:-1] if stopper.reason == 'eos' else out
        logits = forward_with_cache(model, cache, [tok])[0]
