"""attention_decode_bytes with repeat_kv counts the copies written and read (2g) but no longer the cache read they came from."""
CAUGHT_BY = "attention_decode_bytes"


def attention_decode_bytes(config, context, bytes_per_value=4, repeat_kv=False):
    L, N, K, H = config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim
    if repeat_kv:
        return 2 * 2 * L * context * N * H * bytes_per_value
    return 2 * L * context * K * H * bytes_per_value
