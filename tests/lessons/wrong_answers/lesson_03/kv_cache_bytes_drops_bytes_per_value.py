"""kv_cache_bytes does not pass bytes_per_value on to kv_bytes_per_token (always fp32)."""
from tinyserve.roofline import kv_bytes_per_token

CAUGHT_BY = "kv_cache_bytes"


def kv_cache_bytes(config, n_tokens, n_seqs=1, bytes_per_value=4):
    return n_seqs * n_tokens * kv_bytes_per_token(config)
