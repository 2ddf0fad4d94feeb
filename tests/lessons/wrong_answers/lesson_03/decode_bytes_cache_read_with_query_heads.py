"""attention_decode_bytes sizes the cache by the query heads (an MHA cache), not the K/V heads it stores."""
CAUGHT_BY = "attention_decode_bytes"


def attention_decode_bytes(config, context, bytes_per_value=4, repeat_kv=False):
    L, N, H = config.n_layers, config.n_heads, config.head_dim
    read_cache = 2 * L * context * N * H
    repeated = 2 * 2 * L * context * N * H if repeat_kv else 0
    return (read_cache + repeated) * bytes_per_value
