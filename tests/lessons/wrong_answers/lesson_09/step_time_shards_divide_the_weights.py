"""decode_step_time splits the weights over kv_shards chips instead of n_chips (the replicas of the KV heads are
taken for replicas of the weights too): the same whenever kv_shards = n_chips, the default."""
CAUGHT_BY = "decode_step_time"


def decode_step_time(chip, n_chips, batch, params, kv_bytes_per_sequence, bytes_per_param, kv_shards=None):
    kv_shards = n_chips if kv_shards is None else kv_shards
    weights = params * bytes_per_param / (kv_shards * chip.hbm_bandwidth)
    flops = 2 * params * batch / (kv_shards * chip.flops)
    kv = batch * kv_bytes_per_sequence / (kv_shards * chip.hbm_bandwidth)
    return max(weights, flops) + kv
