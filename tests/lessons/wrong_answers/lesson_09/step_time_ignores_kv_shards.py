"""decode_step_time spreads the KV read over all chips even when the cache lives on fewer (kv_shards)."""
CAUGHT_BY = "decode_step_time"


def decode_step_time(chip, n_chips, batch, params, kv_bytes_per_sequence, bytes_per_param, kv_shards=None):
    weights = params * bytes_per_param / (n_chips * chip.hbm_bandwidth)
    flops = 2 * params * batch / (n_chips * chip.flops)
    return max(weights, flops) + batch * kv_bytes_per_sequence / (n_chips * chip.hbm_bandwidth)
