"""kv_bytes_per_token counts K only (forgets the factor 2 for V)."""
CAUGHT_BY = "kv_bytes_per_token"


def kv_bytes_per_token(config, bytes_per_value=4):
    return config.n_layers * config.n_kv_heads * config.head_dim * bytes_per_value
