"""attention_decode_bytes multiplies by 1 + 2K instead of 1 + 2g: right for SmolLM2 only, where g = K = 3."""
CAUGHT_BY = "attention_decode_bytes"


def attention_decode_bytes(config, context, bytes_per_value=4, repeat_kv=False):
    grouped = 2 * config.n_layers * context * config.n_kv_heads * config.head_dim * bytes_per_value
    return grouped * (1 + 2 * config.n_kv_heads) if repeat_kv else grouped
