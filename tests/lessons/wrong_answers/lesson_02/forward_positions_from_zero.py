"""forward_with_cache numbers the new tokens 0..m-1 for RoPE instead of continuing after the cached positions."""
import numpy as np

from tinyserve.kv_cache import cache_attention
from tinyserve.model import forward as model_forward

CAUGHT_BY = "forward_with_cache"


def forward_with_cache(model, cache, tokens, attend=None, all_logits=False):
    tokens = np.asarray(tokens, dtype=np.int64)
    m = len(tokens)
    cache.check_room(m)
    rows = None if all_logits else np.array([m - 1])
    attention = cache_attention(cache) if attend is None else cache_attention(cache, attend)
    logits = model_forward(model, tokens, np.arange(m), attention, logit_rows=rows)
    cache.length += m
    return logits
