"""largest_batch_within solves only the memory-bound branch (T - w) / k, forgetting the FLOPs grow with B."""
CAUGHT_BY = "largest_batch_within"


def largest_batch_within(chip, n_chips, step_time, params, kv_bytes_per_sequence, bytes_per_param, kv_shards=None):
    kv_shards = n_chips if kv_shards is None else kv_shards
    w = params * bytes_per_param / (n_chips * chip.hbm_bandwidth)
    k = kv_bytes_per_sequence / (kv_shards * chip.hbm_bandwidth)
    return max(0, int((step_time - w) / k))
