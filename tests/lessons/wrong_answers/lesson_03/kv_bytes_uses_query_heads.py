"""kv_bytes_per_token uses the number of query heads N instead of the K/V heads K (no GQA saving)."""
CAUGHT_BY = "kv_bytes_per_token"


def kv_bytes_per_token(config, bytes_per_value=4):
    return 2 * config.n_layers * config.n_heads * config.head_dim * bytes_per_value
