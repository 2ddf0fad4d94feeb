"""forward_with_cache always returns every row's logits (runs the LM head on the whole prompt, ignores all_logits)."""
import numpy as np

from tinyserve.kv_cache import cache_attention
from tinyserve.model import forward as model_forward

CAUGHT_BY = "forward_with_cache"


def forward_with_cache(model, cache, tokens, attend=None, all_logits=False):
    tokens = np.asarray(tokens, dtype=np.int64)
    m = len(tokens)
    cache.check_room(m)
    attention = cache_attention(cache) if attend is None else cache_attention(cache, attend)
    logits = model_forward(model, tokens, np.arange(cache.length, cache.length + m), attention)
    cache.length += m
    return logits
