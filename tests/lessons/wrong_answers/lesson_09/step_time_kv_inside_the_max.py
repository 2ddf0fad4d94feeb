"""decode_step_time puts the KV read inside the max with the weight read (max(weights + kv, flops)): the same on a
memory-bound step, but a compute-bound step then hides the KV read, which no matmul overlaps with."""
CAUGHT_BY = "decode_step_time"


def decode_step_time(chip, n_chips, batch, params, kv_bytes_per_sequence, bytes_per_param, kv_shards=None):
    kv_shards = n_chips if kv_shards is None else kv_shards
    weights = params * bytes_per_param / (n_chips * chip.hbm_bandwidth)
    flops = 2 * params * batch / (n_chips * chip.flops)
    kv = batch * kv_bytes_per_sequence / (kv_shards * chip.hbm_bandwidth)
    return max(weights + kv, flops)
