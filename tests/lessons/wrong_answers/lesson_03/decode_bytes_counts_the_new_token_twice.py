"""attention_decode_bytes adds the new token to the context (context + 1 positions): the context already includes it."""
CAUGHT_BY = "attention_decode_bytes"


def attention_decode_bytes(config, context, bytes_per_value=4, repeat_kv=False):
    L, N, K, H = config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim
    S = context + 1
    read_cache = 2 * L * S * K * H
    repeated = 2 * 2 * L * S * N * H if repeat_kv else 0
    return (read_cache + repeated) * bytes_per_value
