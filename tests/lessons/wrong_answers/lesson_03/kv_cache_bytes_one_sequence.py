"""kv_cache_bytes ignores n_seqs."""
from tinyserve.roofline import kv_bytes_per_token

CAUGHT_BY = "kv_cache_bytes"


def kv_cache_bytes(config, n_tokens, n_seqs=1, bytes_per_value=4):
    return n_tokens * kv_bytes_per_token(config, bytes_per_value)
