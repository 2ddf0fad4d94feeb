"""decode_step_time charges every chip the whole batch's KV read (kv_shards never divides it): right on one chip,
n_chips times too slow on a sharded cache."""
CAUGHT_BY = "decode_step_time"


def decode_step_time(chip, n_chips, batch, params, kv_bytes_per_sequence, bytes_per_param, kv_shards=None):
    weights = params * bytes_per_param / (n_chips * chip.hbm_bandwidth)
    flops = 2 * params * batch / (n_chips * chip.flops)
    return max(weights, flops) + batch * kv_bytes_per_sequence / chip.hbm_bandwidth
