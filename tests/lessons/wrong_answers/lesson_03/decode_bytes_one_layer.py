"""attention_decode_bytes counts one layer's cache (forgets that every layer has its own)."""
CAUGHT_BY = "attention_decode_bytes"


def attention_decode_bytes(config, context, bytes_per_value=4, repeat_kv=False):
    N, K, H = config.n_heads, config.n_kv_heads, config.head_dim
    read_cache = 2 * context * K * H
    repeated = 2 * 2 * context * N * H if repeat_kv else 0
    return (read_cache + repeated) * bytes_per_value
