"""decode_step_time reads one sequence's KV per step, as if the batch shared it like the weights (it is per
sequence: never shared)."""
CAUGHT_BY = "decode_step_time"


def decode_step_time(chip, n_chips, batch, params, kv_bytes_per_sequence, bytes_per_param, kv_shards=None):
    kv_shards = n_chips if kv_shards is None else kv_shards
    weights = params * bytes_per_param / (n_chips * chip.hbm_bandwidth)
    flops = 2 * params * batch / (n_chips * chip.flops)
    return max(weights, flops) + kv_bytes_per_sequence / (kv_shards * chip.hbm_bandwidth)
