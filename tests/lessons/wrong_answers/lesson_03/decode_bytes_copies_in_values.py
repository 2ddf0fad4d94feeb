"""attention_decode_bytes applies bytes_per_value to the cache read only: np.repeat's copies are counted in values."""
CAUGHT_BY = "attention_decode_bytes"


def attention_decode_bytes(config, context, bytes_per_value=4, repeat_kv=False):
    L, N, K, H = config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim
    read_cache = 2 * L * context * K * H * bytes_per_value
    repeated = 2 * 2 * L * context * N * H if repeat_kv else 0
    return read_cache + repeated
