"""attention_decode_bytes sizes np.repeat's copy by g heads instead of N = K * g (one group's copy, not all of them)."""
CAUGHT_BY = "attention_decode_bytes"


def attention_decode_bytes(config, context, bytes_per_value=4, repeat_kv=False):
    L, K, H = config.n_layers, config.n_kv_heads, config.head_dim
    g = config.n_heads // K
    read_cache = 2 * L * context * K * H
    repeated = 2 * 2 * L * context * g * H if repeat_kv else 0
    return (read_cache + repeated) * bytes_per_value
